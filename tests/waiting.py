"""Waiting in tests for what another thread or process does next, one way everywhere.

``settled`` polls until a condition holds and returns the last value read, so the test's own assertion shows
what it saw when time ran out; ``wait_until`` raises instead. Neither sleeps longer than ``interval`` past the
moment the condition holds: a test waits for an event, not for a guessed duration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def settled(
    read: Callable[[], T], until: Callable[[T], bool], timeout: float = 10.0, interval: float = 0.05
) -> T:
    """``read()`` once ``until(value)`` holds, or its last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    value = read()
    while not until(value) and time.monotonic() < deadline:
        time.sleep(interval)
        value = read()
    return value


def wait_until(check: Callable[[], T], what: str, timeout: float = 20.0, interval: float = 0.05) -> T:
    """The first truthy ``check()``; AssertionError naming ``what`` after ``timeout`` seconds."""
    value = settled(check, bool, timeout, interval)
    assert value, f"timed out after {timeout} s waiting for {what}"
    return value
