"""``make wheelhouse`` (deploy/wheelhouse.py): loraserve's wheel and the wheels it needs, resolved for another
interpreter and platform than this one, for hosts that reach no package index (docs/tpu.md).

It asks the package index (CI and developers reach PyPI), so the case is small: the base install (no extras),
resolved for CPython 3.11 on x86-64 Linux, everything but two pure-Python distributions skipped."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_wheelhouse_holds_the_project_and_what_was_not_skipped(tmp_path: Path) -> None:
    out = tmp_path / "wheels"
    skip = "grpcio,grpcio-health-checking,grpcio-reflection,protobuf,typing-extensions"
    done = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "wheelhouse.py"), "--out", str(out), "--extras", "",
         "--skip", skip, "--python", "3.11", "--platform", "manylinux2014_x86_64"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    wheels = sorted(p.name for p in out.glob("*.whl"))
    names = {w.split("-")[0].lower().replace("_", "-") for w in wheels}
    assert names == {"loraserve", "fsspec", "prometheus-client"}, wheels
    with zipfile.ZipFile(next(out.glob("loraserve-*.whl"))) as wheel:
        assert "loraserve/protos/v1/inference_pb2.py" in wheel.namelist()  # built with the generated protos
    lines = (out / "requirements.txt").read_text().splitlines()
    pinned = {line.split("==")[0]: line for line in lines}
    assert {"fsspec", "grpcio", "grpcio-health-checking", "grpcio-reflection", "prometheus-client",
            "protobuf"} <= set(pinned)  # fmt: skip
    assert pinned["grpcio"].endswith("# skipped: the host has it") and "skipped" not in pinned["fsspec"]
    assert "pip install --no-index --find-links" in done.stdout

    # a TPU host's tests run against the installed package: the installed files are compared with the checkout
    # (bench/tpu_session.sh stops when they differ, before spending chip time on older code)
    site = tmp_path / "site"
    with zipfile.ZipFile(next(out.glob("loraserve-*.whl"))) as wheel:
        wheel.extractall(site)
    compare = [sys.executable, str(ROOT / "deploy" / "wheelhouse.py"), "--compare-installed", str(site)]
    same = subprocess.run(compare, capture_output=True, text=True, timeout=60)
    assert (same.returncode, same.stdout) == (0, "")
    (site / "loraserve" / "engine" / "engine.py").write_text("# an older engine\n")
    (site / "loraserve" / "common" / "errors.py").unlink()
    (site / "loraserve" / "kernels" / "gone.py").write_text("")
    stale = subprocess.run(compare, capture_output=True, text=True, timeout=60)
    assert stale.returncode == 1
    assert stale.stdout.splitlines() == [
        f"differs from the checkout: {name}"
        for name in ("common/errors.py", "engine/engine.py", "kernels/gone.py")
    ]
