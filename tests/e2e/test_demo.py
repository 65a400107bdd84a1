"""``loraserve demo`` (what ``make demo`` runs) from an empty work folder: builds, serves, answers, exits 0."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import with_test_xla_flags

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_runs_the_whole_stack_from_nothing(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loraserve", "demo", "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=480,
        env=with_test_xla_flags(),  # compile-bound (a worker warming up, 3 short answers): the tests' XLA level
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for name, answer in (("demo-red", "' red'"), ("demo-green", "' green'"), ("demo-blue", "' blue'")):
        row = next(line for line in lines if line.startswith(name))
        assert answer in row and row.rstrip().endswith("ok") and " eos " in row
    assert "[demo] all adapters answered as trained" in lines
    assert "[demo] registry, worker and router shut down cleanly" in lines
    assert not list((tmp_path / "demo").glob("run-*"))  # the run's database and store are cleaned up
