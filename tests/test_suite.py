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
