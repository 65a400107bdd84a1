"""The registry's clock: what leases, heartbeats, expiry and alias changes read as "now", and what its read caches
(the fleet view, resolved names) time their TTLs by.

One object with two readings, passed in where the registry is assembled (``registry.app.open_registry``) and
handed to :class:`~loraserve.registry.placement.Placement`, :class:`~loraserve.registry.catalog.Catalog` and
:class:`~loraserve.registry.aliases.Aliases`. :data:`SYSTEM_CLOCK` (the default) reads the machine's clocks;
a test passes a :class:`ManualClock` and advances it past a lease or a TTL instead of sleeping. Timeouts that
bound real I/O (``registry.imports``' read timeout, the blob store's retries, ``gc``'s file ages) stay on the
real clocks.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """Wall time, timezone-aware UTC: what the database's lease and change timestamps hold."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin, never going back: what in-memory TTLs are timed by."""
        ...


class SystemClock:
    """The machine's clocks: ``datetime.now(UTC)`` and ``time.monotonic()``."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK: Clock = SystemClock()


class ManualClock:
    """A clock that moves only when told (:meth:`advance`); both readings move together. Thread-safe: the
    registry's threads read it while a test advances it. Starts at the real wall time (so timestamps look
    real) and at monotonic 0."""

    def __init__(self, start: datetime | None = None) -> None:
        self._lock = threading.Lock()
        self._now = start if start is not None else datetime.now(UTC)
        self._monotonic = 0.0

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._monotonic

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        with self._lock:
            self._now += timedelta(seconds=seconds)
            self._monotonic += seconds
