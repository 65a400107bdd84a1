"""The suite's own rules: the longest files go first (tests/conftest.py); subprocesses time out before pytest;
`make test`'s exclusive run reads the files that hold exclusive tests."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import EXCLUSIVE_MARK, LONGEST_FILES, _check_exclusive_files, _longest_first

ROOT = Path(__file__).resolve().parent.parent


class _Item:
    def __init__(self, path: str, exclusive: bool = False) -> None:
        self.path = ROOT / path
        self.exclusive = exclusive

    def get_closest_marker(self, name: str) -> object:
        return True if name == "exclusive" and self.exclusive else None


def test_every_listed_file_exists_once() -> None:
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
    assert [f for f in LONGEST_FILES if not (ROOT / f).is_file()] == []


def test_listed_files_come_first_and_the_rest_keep_their_order() -> None:
    names = ["tests/a_test.py", LONGEST_FILES[1], "tests/b_test.py", LONGEST_FILES[0], LONGEST_FILES[1]]
    items = [_Item(n) for n in names]
    _longest_first(items)
    got = [i.path.relative_to(ROOT).as_posix() for i in items]
    assert got == [LONGEST_FILES[0], LONGEST_FILES[1], LONGEST_FILES[1], "tests/a_test.py", "tests/b_test.py"]


def test_subprocess_timeouts_end_before_pytest_s() -> None:
    """A test's own subprocess timeout fires before pytest-timeout's (which kills the test, not the child,
    and says less): every literal ``timeout=N`` in the tests is under the configured limit."""
    import re
    import tomllib

    limit = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
    over = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "tests").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for value in re.findall(r"\btimeout=(\d+)", line)
        if int(value) >= limit
    ]
    assert over == []


def test_make_test_runs_the_exclusive_tests_from_the_files_that_mark_them() -> None:
    """The Makefile's exclusive run names exactly the test files that match EXCLUSIVE_MARK (among them the
    security suites'), and a test marked exclusive in a file that does not match stops the collection."""
    shown = subprocess.run(["make", "-s", "-n", "test"], cwd=ROOT, capture_output=True, text=True, check=True)
    line = next(ln for ln in shown.stdout.splitlines() if "-m exclusive" in ln)
    named = set(re.findall(r"tests/\S+\.py", line))
    expected = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if re.search(EXCLUSIVE_MARK, path.read_text())
    }
    assert named == expected and "tests/security/test_hostile_requests.py" in named
    _check_exclusive_files([_Item("tests/security/test_hostile_requests.py", exclusive=True)])
    with pytest.raises(pytest.UsageError, match=r"test_suite\.py"):
        _check_exclusive_files([_Item("tests/test_suite.py", exclusive=True)])


TPU_SH = ROOT / "tests" / "tpu.sh"


def _tpu_sh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    import os
    import sys

    return subprocess.run(
        ["bash", str(TPU_SH), *args],
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_make_test_tpu_selects_files_that_exist_and_shards_them() -> None:
    """`make test-tpu` (tests/tpu.sh): every file it selects exists; TPU_SHARD=i/n splits the in-process
    selection into n disjoint parts that cover it, the stack run goes with the last; a bad shard is refused."""
    text = TPU_SH.read_text()
    listed = re.findall(r"^    (tests/\S+)$", text, re.M)
    assert listed and [f for f in listed if not (ROOT / f).exists()] == []
    parts = []
    for i in (1, 2, 3):
        shown = _tpu_sh({"PYTHON": "echo", "TPU_SHARD": f"{i}/3"})
        assert shown.returncode == 0, shown.stderr
        parts.append([word for word in shown.stdout.split() if word.startswith(str(ROOT / "tests"))])
    stack = [p for part in parts for p in part if "/tests/e2e/" in p]
    assert len(stack) == 2 and all("/tests/e2e/" in p for p in parts[2][-2:])
    inprocess = [p for part in parts for p in part if "/tests/e2e/" not in p]
    assert sorted(inprocess) == sorted(str(ROOT / f) for f in listed if not f.startswith("tests/e2e/"))
    assert _tpu_sh({"TPU_SHARD": "4/3"}).returncode == 2


def test_make_test_tpu_runs_from_outside_the_checkout() -> None:
    """tests/tpu.sh runs pytest from outside the checkout on the selection it is given (here one CPU file, no
    stack run), against loraserve as installed, and passes pytest's status on."""
    done = _tpu_sh(
        {"TPU_TESTS": "tests/kernels/test_reference.py", "TPU_STACK_TESTS": ""}, "-q", "-p", "no:xdist"
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", done.stdout)
    failing = _tpu_sh({"TPU_TESTS": "tests/no_such_file.py", "TPU_STACK_TESTS": ""}, "-q")
    assert failing.returncode != 0
