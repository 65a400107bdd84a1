"""The rooms and what each may import (DESIGN.md §10.1, docs/architecture.md): an import-graph check over the
source, lazy imports inside functions included. A violation names the file, the line and the import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("protos", "common", "adapters", "kernels", "worker", "registry", "router", "httpapi", "client")

# room -> the rooms of ours it may import (itself always). `loraserve` (the root package: the CLI dispatcher,
# the demo, the test-model builders) may import every room and is imported by none but tests and bench.
ALLOWED: dict[str, set[str]] = {
    "protos": set(),
    "common": {"protos"},
    "adapters": {"common"},
    "kernels": set(),
    "worker": {"protos", "common", "adapters", "kernels", "httpapi"},
    "registry": {"protos", "common", "adapters"},
    "router": {"protos", "common", "adapters", "httpapi"},
    "httpapi": {"protos", "common", "adapters"},
    "client": {"protos", "common", "adapters"},
}
# Third-party packages a room must not import at all: the base install (client, common, adapters, protos,
# router) has no JAX, torch, SQLAlchemy or numpy; the registry needs no JAX; kernels no servers.
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "protos": {"jax", "torch", "sqlalchemy", "numpy"},
    "common": {"jax", "torch", "sqlalchemy", "numpy", "transformers"},
    "adapters": {"jax", "torch", "sqlalchemy", "transformers"},
    "client": {"jax", "torch", "sqlalchemy", "numpy", "transformers", "safetensors"},
    "router": {"jax", "torch", "sqlalchemy", "numpy", "transformers"},
    "httpapi": {"jax", "torch", "sqlalchemy", "numpy", "transformers"},
    "registry": {"jax", "torch", "transformers"},
    "kernels": {"torch", "sqlalchemy", "grpc"},
    "worker": {"torch", "sqlalchemy", "peft"},
}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports, absolute (relative imports resolved), with its line."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno}: relative import; use loraserve.<room>")
            base = node.module or ""
            out.append((node.lineno, base))
            if base == "loraserve":  # `from loraserve import kernels` imports the room
                out += [(node.lineno, f"loraserve.{alias.name}") for alias in node.names]
    return out


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "loraserve":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else "loraserve"


def violations(room: str) -> list[str]:
    found = []
    for path in sorted((ROOT / room).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        for line, module in imports_of(path):
            where = f"{path.relative_to(ROOT)}:{line}: imports {module}"
            target = room_of(module)
            if target is None:
                if module.split(".")[0] in FORBIDDEN_THIRD_PARTY[room]:
                    found.append(f"{where} (third-party package not allowed in {room})")
            elif target == "loraserve" and module != "loraserve":
                found.append(f"{where} (the root package is imported by no room)")
            elif target not in ({room, "loraserve"} | ALLOWED[room]):
                found.append(f"{where} ({room} may import {sorted(ALLOWED[room]) or 'nothing of ours'})")
    return found


@pytest.mark.parametrize("room", ROOMS)
def test_room_imports_follow_the_dependency_direction(room: str) -> None:
    assert violations(room) == []


def test_the_checker_catches_a_violation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules bite: a client module that imports the worker lazily, and one that imports JAX."""
    fake_root = tmp_path
    (fake_root / "client").mkdir()
    (fake_root / "client" / "bad.py").write_text(
        "import grpc\n\ndef f():\n    from loraserve.worker.engine import Engine\n    import jax.numpy\n"
    )
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", fake_root)
    assert violations("client") == [
        "client/bad.py:4: imports loraserve.worker.engine (client may import ['adapters', 'common', 'protos'])",
        "client/bad.py:5: imports jax.numpy (third-party package not allowed in client)",
    ]


def test_every_room_is_checked() -> None:
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "loraserve", "bench"}
    assert folders == set(ROOMS)
