"""Generate the Python modules of the loraserve.v1 contract from ``protos/v1/*.proto``.

Run as ``python -m protos.build`` (``make protos`` does). Outputs sit beside their sources:
``X_pb2.py``, ``X_pb2.pyi`` and ``X_pb2_grpc.py``; imports between them are absolute
(``from protos.v1 import worker_admin_pb2``) because the include root is the repository root.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path(__file__).resolve().parent / "v1"


def proto_sources() -> list[Path]:
    """Every ``.proto`` file of the contract, sorted for a stable build."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate() -> list[Path]:
    """Compile every ``.proto`` into Python modules and type stubs; returns the sources compiled."""
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    sources = proto_sources()
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{well_known}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *(str(p.relative_to(ROOT)) for p in sources),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {[p.name for p in sources]}")
    (PROTO_DIR / "__init__.py").touch()
    return sources


def main() -> int:
    sources = generate()
    print(f"generated Python modules for {len(sources)} proto files in {PROTO_DIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
