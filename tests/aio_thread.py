"""Run a grpc.aio server on its own event loop in a background thread, for synchronous tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc


@contextmanager
def aio_server_thread(build: Callable[[], Awaitable[tuple[grpc.aio.Server, int]]]) -> Iterator[int]:
    """``build`` (run on the thread's loop) returns a started-or-not server and its port; yields the port."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        try:
            server, port = await build()
            await server.start()
        except BaseException as exc:  # surface start-up errors to the test
            holder["error"] = exc
            started.set()
            return
        holder.update(port=port, stop=asyncio.Event())
        started.set()
        await holder["stop"].wait()
        await server.stop(grace=1)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(60), "server did not start"
    if "error" in holder:
        raise holder["error"]
    try:
        yield holder["port"]
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(10)
        loop.close()


@contextmanager
def http_server_thread(make_app: Callable[[], Any], security: Any = None) -> Iterator[int]:
    """Serve the ASGI app ``make_app()`` (built on the thread's own loop) with ``HttpServer``; yields its port."""
    from loraserve.httpapi.server import HttpServer

    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        try:
            http = HttpServer(make_app(), "127.0.0.1", 0, security)
        except BaseException as exc:
            holder["error"] = exc
            started.set()
            return
        task = asyncio.ensure_future(http.run())
        holder.update(port=http.port, stop=asyncio.Event())
        started.set()
        await holder["stop"].wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(60), "HTTP server did not start"
    if "error" in holder:
        raise holder["error"]
    try:
        yield holder["port"]
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(15)
        loop.close()
