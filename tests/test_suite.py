"""The suite's own rules: the longest files go first (tests/conftest.py); subprocesses time out before pytest."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FILES, _longest_first

ROOT = Path(__file__).resolve().parent.parent


class _Item:
    def __init__(self, path: str) -> None:
        self.path = ROOT / path


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
