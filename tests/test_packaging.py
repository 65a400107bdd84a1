"""One import root (docs/design.md §10.1): the wheel installs `loraserve` and nothing else, with every room in it,
and no module of ours is ever loaded under its bare folder name."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("protos", "common", "adapters", "kernels", "worker", "registry", "router", "client")
BARE = ("protos", "kernels", "worker", "registry", "router", "client", "common", "adapters")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools stages files in <repo>/build/lib and never deletes stale ones: a module removed from the
    # source would still be packed. Start from no staging folder, and leave none behind.
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    (path,) = out.glob("loraserve-*.whl")
    return zipfile.ZipFile(path)


def test_loraserve_is_the_only_top_level_name(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist()}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert len(dist_info) == 1
    assert tops - dist_info == {"loraserve"}
    (top_level,) = [n for n in wheel.namelist() if n.endswith("top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["loraserve"]


def test_every_module_of_every_room_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for folder in ROOMS:
        for src in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in src.parts:
                continue
            rel = src.relative_to(ROOT / folder).as_posix()
            assert f"loraserve/{folder}/{rel}" in names, f"{folder}/{rel} is missing from the wheel"
    # data the rooms read at run time
    for data in (
        "kernels/csrc/lora.cc",
        "kernels/csrc/attention.cc",
        "kernels/csrc/linear.cc",
        "kernels/csrc/common.h",
        "protos/v1/inference.proto",
        "registry/migrations/script.py.mako",
    ):
        assert f"loraserve/{data}" in names


def test_no_module_is_loaded_under_its_bare_folder_name() -> None:
    """Import every module of every room from the repository root (where the bare folders are importable)
    and check that none of them pulled in a bare name: one module, one name, one copy of its state."""
    code = f"""
import importlib, pkgutil, sys
import loraserve
for room in {sorted(ROOMS)!r}:
    pkg = importlib.import_module("loraserve." + room)
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if ".migrations" in info.name or info.name.endswith(("demo", "gcs_emulator")):
            continue
        importlib.import_module(info.name)
bare = sorted(m for m in sys.modules if m.split(".")[0] in {BARE!r})
print(len([m for m in sys.modules if m.startswith("loraserve.")]), bare)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    count, bare = out.stdout.split(" ", 1)
    assert int(count) > 50
    assert bare.strip() == "[]"
