"""Generate the Python modules of the loraserve.v1 contract from ``protos/v1/*.proto``.

Run as ``python -m loraserve.protos.build`` (``make protos`` does). Outputs sit beside their sources:
``X_pb2.py``, ``X_pb2.pyi`` and ``X_pb2_grpc.py``. protoc runs over an include root in which this folder
is ``loraserve/protos`` (a symbolic link in a temporary folder), so the generated imports are the installed
names (``from loraserve.protos.v1 import worker_admin_pb2``) and the files register as
``loraserve/protos/v1/*.proto``, the path that ``.proto`` imports use.
"""

from __future__ import annotations

import sys
import tempfile
from importlib import resources
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_DIR = PACKAGE_DIR / "v1"
IMPORT_PREFIX = Path("loraserve/protos")  # where PACKAGE_DIR sits under the include root


def proto_sources() -> list[Path]:
    """Every ``.proto`` file of the contract, sorted for a stable build."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate() -> list[Path]:
    """Compile every ``.proto`` into Python modules and type stubs; returns the sources compiled."""
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    sources = proto_sources()
    with tempfile.TemporaryDirectory(prefix="loraserve-protos-") as tmp:
        root = Path(tmp)
        (root / IMPORT_PREFIX.parent).mkdir(parents=True)
        (root / IMPORT_PREFIX).symlink_to(PACKAGE_DIR, target_is_directory=True)
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{well_known}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            *(str(IMPORT_PREFIX / p.relative_to(PACKAGE_DIR)) for p in sources),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {[p.name for p in sources]}")
    return sources


def main() -> int:
    sources = generate()
    print(f"generated Python modules for {len(sources)} proto files in {PROTO_DIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
