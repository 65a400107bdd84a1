"""Blocking work off the event loop, on a few threads of its own per kind of work.

A server's event loop must never run what a client can make long (parsing a 16 MiB body, tokenising a
prompt, rendering a chat template), and that work must not queue in the loop's default executor either,
where start-up and other blocking calls wait. ``OffLoop("name")`` is such a pool, created on first use;
``await off_loop(fn, *args)`` runs ``fn(*args)`` there and raises its exception (a refusal) in the caller.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class OffLoop:
    """A named pool of ``max(2, min(4, cores))`` threads for one kind of blocking work."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                workers = max(2, min(4, os.cpu_count() or 1))
                self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self.name)
            return self._pool

    async def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
