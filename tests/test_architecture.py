"""The rooms and what each may import (docs/design.md §10.1, docs/architecture.md): an import-graph check over the
source, lazy imports inside functions included. A violation names the file, the line and the import."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOMS = (
    "protos",
    "common",
    "adapters",
    "kernels",
    "models",
    "engine",
    "worker",
    "registry",
    "router",
    "httpapi",
    "client",
)
# the root package `loraserve` (the command line, the demo, the test-model builders) is this folder: no folder
# of the checkout is named `loraserve`, so Python started in it imports the installed package
ROOT_FOLDER = "command"

# room -> the rooms of ours it may import (itself always): worker -> engine -> models -> kernels, one way; the
# engine speaks no protos. `loraserve` (the root package, ROOT_FOLDER: the CLI dispatcher, the demo, the
# test-model builders) may import every room and is imported by none but tests and bench.
ALLOWED: dict[str, set[str]] = {
    "protos": set(),
    "common": {"protos"},
    "adapters": {"common"},
    "kernels": set(),
    "models": {"common", "adapters", "kernels"},
    "engine": {"common", "adapters", "kernels", "models"},
    "worker": {"protos", "common", "adapters", "kernels", "models", "engine", "httpapi"},
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
    "models": {"torch", "sqlalchemy", "peft", "grpc"},
    "engine": {"torch", "sqlalchemy", "peft"},
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
        "import grpc\n\ndef f():\n    from loraserve.engine.engine import Engine\n    import jax.numpy\n"
    )
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", fake_root)
    assert violations("client") == [
        "client/bad.py:4: imports loraserve.engine.engine (client may import ['adapters', 'common', 'protos'])",
        "client/bad.py:5: imports jax.numpy (third-party package not allowed in client)",
    ]


def test_every_room_is_checked() -> None:
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", ROOT_FOLDER, "bench"}
    assert folders == set(ROOMS)


# ----------------------------------------------------------------------------------------------- base install
# What `pip install loraserve` brings (pyproject's `dependencies`) -> the import names it provides. Everything
# the base install runs (the router, the SDK, the CLI's client commands, `loraserve --help`) may import these,
# the standard library and our own modules, and nothing else: numpy, JAX, torch, SQLAlchemy, safetensors,
# transformers... come with the extras only.
BASE_DEPENDENCIES = {
    "grpcio": "grpc",
    "grpcio-health-checking": "grpc_health",
    "grpcio-reflection": "grpc_reflection",
    "protobuf": "google.protobuf",
    "fsspec": "fsspec",
    "prometheus-client": "prometheus_client",
}
# Modules whose functions run in the base install too: their lazy imports (inside functions) count as well.
# Elsewhere (`loraserve.worker.cli`, `loraserve.demo`...: `loraserve --help` imports them to build its parser,
# their `run` needs an extra) only the imports that run when the module is imported count.
BASE_ROOMS = ("protos", "common", "adapters", "client", "router")
BASE_ROOT_MODULES = ("loraserve", "loraserve.cli", "loraserve.__main__", "loraserve.version")
# Lazy imports of an extra's code from a base module: `loraserve router serve --http-port` needs `[http]`.
EXTRA_ONLY = ("loraserve.httpapi", "loraserve.router.http_backend")


def base_entry_points() -> list[str]:
    """The router's server, every client module (the SDK) and the CLI: `loraserve` imports every command's
    module to build its parser, so each of those is one too."""
    from loraserve.cli import COMMANDS

    clients = sorted(
        f"loraserve.client.{p.stem}" for p in (ROOT / "client").glob("*.py") if p.stem != "__init__"
    )
    return [
        "loraserve.__main__",
        "loraserve.cli",
        *(module for module, _ in COMMANDS.values()),
        "loraserve.router.server",
        "loraserve.router.routing",
        *clients,
    ]


def module_file(module: str) -> Path | None:
    """Our module's source file (None for a name that is no module of ours, e.g. a class imported by name)."""
    parts = module.split(".")
    if parts[0] != "loraserve":
        return None
    if len(parts) > 1 and parts[1] in ROOMS:
        base, rest = ROOT / parts[1], parts[2:]
    else:
        base, rest = ROOT / ROOT_FOLDER, parts[1:]
    for candidate in (
        base.joinpath(*rest).with_suffix(".py") if rest else None,
        base.joinpath(*rest, "__init__.py"),
    ):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(path: Path, lazy: bool) -> list[tuple[int, str, bool]]:
    """``(line, module, inside a function)`` for what a file imports when it is imported (class bodies,
    top-level `if`/`try` included; not under `if TYPE_CHECKING`), plus, with ``lazy``, what its functions
    import; `from loraserve.a import b` also names `loraserve.a.b` (which may be a module)."""
    out: list[tuple[int, str, bool]] = []

    def visit(nodes: list[ast.stmt], in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                out.extend((node.lineno, alias.name, in_function) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                out.append((node.lineno, base, in_function))
                if base.split(".")[0] == "loraserve":
                    out.extend((node.lineno, f"{base}.{alias.name}", in_function) for alias in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if lazy:
                    visit(node.body, True)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse, in_function)
            else:  # class bodies, if/try/with/for/match blocks
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child], in_function)
                    elif isinstance(child, (ast.excepthandler, ast.match_case)):
                        visit(child.body, in_function)

    visit(ast.parse(path.read_text(), str(path)).body, False)
    return out


def _is_within(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(f"{p}.") for p in packages)


def runs_in_base(module: str) -> bool:
    return module in BASE_ROOT_MODULES or (room_of(module) or "") in BASE_ROOMS


def base_install_violations(entry_points: list[str]) -> list[str]:
    """Walk the imports of ``entry_points`` through our own modules (parent packages included, as Python
    imports them); every import of a package the base install lacks, with the chain that reaches it."""
    allowed = set(BASE_DEPENDENCIES.values()) | set(sys.stdlib_module_names)
    chain: dict[str, str | None] = {}
    queue: deque[str] = deque()

    def reach(module: str, parent: str | None) -> None:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
            name = ".".join(parts[:i])
            if name not in chain and module_file(name) is not None:
                chain[name] = parent
                queue.append(name)

    for entry in entry_points:
        assert module_file(entry) is not None, f"entry point {entry} is no module of ours"
        reach(entry, None)
    found = []
    while queue:
        module = queue.popleft()
        path = module_file(module)
        assert path is not None
        for line, imported, in_function in runtime_imports(path, lazy=runs_in_base(module)):
            if imported.split(".")[0] == "loraserve":
                if not (in_function and _is_within(imported, EXTRA_ONLY)):
                    reach(imported, module)
            elif not _is_within(imported, allowed):
                via, hop = [], chain[module]
                while hop is not None:
                    via.append(hop)
                    hop = chain[hop]
                route = " <- ".join([module, *via])
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {imported} (reached from {route})")
    return found


def test_base_dependencies_match_pyproject() -> None:
    """A new base dependency must name its import here, or the check below would refuse it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[A-Za-z0-9._-]+", dep).group() for dep in project["dependencies"]}
    assert names == set(BASE_DEPENDENCIES)


def test_the_base_install_imports_nothing_of_the_extras() -> None:
    """Transitively, from every base-install entry point: the router (`loraserve router serve`), the SDK,
    the CLI and its client commands import only the standard library, the base dependencies and our modules
    that do the same (tests/e2e/test_base_install.py runs them with the extras made unimportable)."""
    assert base_install_violations(base_entry_points()) == []


def test_the_transitive_check_catches_a_violation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two hops away, at module level, is caught, and so is numpy imported inside a router function or the
    `[http]` extra imported at a router module's top; a lazy import in a worker module (`loraserve --help`
    imports it, its `run` needs the worker extra) and a lazy import of the extra from the router are not."""
    for room, files in {
        "router": {
            "server.py": "from loraserve.adapters import mixes\n\ndef f():\n    from loraserve.httpapi import app\n",
            "routing.py": "def g():\n    import numpy\n",
            "config.py": "import loraserve.httpapi.app\n",
        },
        "adapters": {
            "mixes.py": "from loraserve.adapters.peft import x\n",
            "peft.py": "import numpy as np\n",
        },
        "httpapi": {"app.py": "import fastapi\n"},
        "worker": {"cli.py": "import argparse\n\ndef run():\n    import jax\n"},
    }.items():
        (tmp_path / room).mkdir()
        for name, text in {"__init__.py": "", **files}.items():
            (tmp_path / room / name).write_text(text)
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    entries = [
        "loraserve.router.server",
        "loraserve.router.routing",
        "loraserve.worker.cli",
        "loraserve.router.config",
    ]
    assert base_install_violations(entries) == [
        "router/routing.py:2: imports numpy (reached from loraserve.router.routing)",
        "httpapi/app.py:1: imports fastapi (reached from loraserve.httpapi.app <- loraserve.router.config)",
        "adapters/peft.py:1: imports numpy (reached from loraserve.adapters.peft <- loraserve.adapters.mixes"
        " <- loraserve.router.server)",
    ]


# ------------------------------------------------------------------------------------- docs/architecture.md
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"


def documented_rooms(doc: str) -> dict[str, str]:
    """docs/architecture.md's room table: room (its folder, without the slash) -> its "may import" cell."""
    section = doc.split("## The rooms", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(\w+)/`", cells[0]) if len(cells) == 4 else None
        if m:
            rows[m.group(1)] = cells[3]
    return rows


def test_the_docs_room_table_is_the_enforced_rules() -> None:
    """The rooms docs/architecture.md lists, and what it says each may import, are ALLOWED: neither can change
    without the other. The root package's row says it may import every room."""
    rows = documented_rooms(ARCHITECTURE_DOC.read_text())
    assert set(rows) == set(ROOMS) | {ROOT_FOLDER}
    assert rows[ROOT_FOLDER].startswith("every room")
    documented = {
        room: set() if cell == "nothing" else set(re.findall(r"`(\w+)`", cell))
        for room, cell in rows.items()
        if room != ROOT_FOLDER
    }
    assert documented == ALLOWED


def test_the_docs_drawing_names_every_room() -> None:
    doc = ARCHITECTURE_DOC.read_text()
    section = doc.split("## The rooms", 1)[1].split("\n## ", 1)[0]
    drawing = section.split("```", 2)[1]
    assert {
        room for room in (*ROOMS, ROOT_FOLDER, "loraserve") if not re.search(rf"\b{room}\b", drawing)
    } == set()


def documented_files(doc: str) -> dict[str, dict[str, str]]:
    """docs/architecture.md's file tables: room folder -> {file path inside it: what it holds}."""
    section = doc.split("## Files, room by room", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, dict[str, str]] = {}
    for part in section.split("\n### ")[1:]:
        heading, _, body = part.partition("\n")
        room = re.fullmatch(r"`(\w+)/`", heading.strip())
        assert room, f"a heading that names no room folder: {heading!r}"
        rows = tables.setdefault(room.group(1), {})
        for line in body.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            m = re.fullmatch(r"`([\w/]+\.py)`", cells[0]) if len(cells) == 2 else None
            if m:
                rows[m.group(1)] = cells[1]
    return tables


def source_files(folder: str) -> set[str]:
    """A room's modules as the file tables name them: paths inside the folder; the room's own `__init__.py`
    (the room table's row says what it holds), a sub-package's that holds only a docstring and the generated
    gRPC modules left out."""
    return {
        path.relative_to(ROOT / folder).as_posix()
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
        and "_pb2" not in path.name
        and path != ROOT / folder / "__init__.py"
        and not _only_a_docstring(path)
    }


def _only_a_docstring(path: Path) -> bool:
    """A package's ``__init__.py`` that holds nothing but its docstring (the room's row says it); one that holds
    code is a module like the others."""
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(
        (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        or (isinstance(node, ast.ImportFrom) and node.module == "__future__")
        for node in body
    )


def test_every_module_has_a_row_in_the_docs_file_tables() -> None:
    """A new module needs its row, a moved or deleted one takes its row away: the map stays the territory."""
    tables = documented_files(ARCHITECTURE_DOC.read_text())
    assert set(tables) == set(ROOMS) | {ROOT_FOLDER}
    for folder, rows in tables.items():
        assert set(rows) == source_files(folder), folder
        assert all(len(what) > 10 for what in rows.values()), folder


# ------------------------------------------------------------------------------------------ layout and loops
def test_no_folder_shadows_the_installed_package() -> None:
    """Python started in the checkout (a script, pytest from the root, a TPU host given a wheel) puts the
    checkout first on sys.path: a folder named `loraserve` there would be imported instead of the installed
    package. The root package lives in ROOT_FOLDER, and every room maps to its folder."""
    assert not (ROOT / "loraserve").exists()
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert dirs == {"loraserve": ROOT_FOLDER, **{f"loraserve.{room}": room for room in ROOMS}}


def our_modules() -> dict[str, Path]:
    """Every module of ours: dotted name -> file."""
    out = {}
    for folder, package in [(ROOT_FOLDER, "loraserve"), *((room, f"loraserve.{room}") for room in ROOMS)]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            if "__pycache__" in rel:
                continue
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join((package, *parts))] = path
    return out


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """The import graph's cycles (strongly connected components of more than one module), lazy imports
    inside functions counted: a loop through them is a loop all the same."""
    graph = {
        name: sorted(
            {
                m
                for _, m, _ in runtime_imports(path, lazy=True)
                if m in modules and m != name and m.startswith(name + ".") is False
            }
        )
        for name, path in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            connect(v)
    return cycles


def test_no_import_loops_even_through_lazy_imports() -> None:
    assert import_cycles(our_modules()) == []


def test_the_loop_check_catches_a_lazy_loop(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from loraserve.models import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from loraserve.models.a import x\n")
    (tmp_path / "c.py").write_text("import loraserve.models.a\n")
    modules = {f"loraserve.models.{n}": tmp_path / f"{n}.py" for n in "abc"}
    assert import_cycles(modules) == [["loraserve.models.a", "loraserve.models.b"]]
