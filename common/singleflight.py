"""One call per key at a time, its result shared by every caller that asks while it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class SingleFlight:
    """One call per key at a time, shared by every caller that asks while it runs: a cache that expires
    under load refreshes once, not once per waiting request (a herd of 500 ``ListWorkers`` calls took the
    registry two seconds of CPU each time the router's cache of them expired). A caller that is cancelled
    leaves the call running for the others; its error reaches every caller."""

    def __init__(self) -> None:
        self._running: dict[Any, asyncio.Future] = {}

    async def run(self, key: Any, fn: Callable[[], Awaitable[T]]) -> T:
        task = self._running.get(key)
        if task is None:
            task = self._running[key] = asyncio.ensure_future(fn())
            task.add_done_callback(lambda t: self._settled(key, t))
        return await asyncio.shield(task)

    def _settled(self, key: Any, task: asyncio.Future) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        if not task.cancelled():
            task.exception()  # retrieved: every caller gone is no "exception never retrieved" warning
