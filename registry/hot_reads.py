"""LocateAdapter's one database read, awaited on the server's event loop instead of a thread hop.

Every other RPC runs its blocking catalog work on a thread (``registry.server._call``). For LocateAdapter,
the router's per-request question, that hop was most of the time above gRPC's own floor: with many workers
heartbeating, a hand-off to a pool thread and back waits for the GIL behind heartbeat threads
(docs/performance.md has the numbers). So a locate resolves its name with one of these, picked by the
database the registry runs on:

* :class:`InlineReads` (SQLite): the prebuilt statement on a plain connection, on the event loop itself.
  A read of a local WAL-mode file is quick and never waits for a writer.
* :class:`PsycopgReads` (PostgreSQL through psycopg, the production choice): psycopg's asyncio
  connections, a few kept open per event loop, in autocommit mode (one round trip a read). Nothing blocks
  the loop while the database answers.
* :class:`ThreadReads` (any other database): the statement on a thread, as before.

A failure raises the driver's own error (``OperationalError`` for an unreachable database), which the
servicer maps to UNAVAILABLE like every other RPC's.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol

from sqlalchemy.engine import Engine


class HotReads(Protocol):
    """Awaitable single-row reads of prebuilt SQLAlchemy Core statements."""

    async def first(self, stmt: Any, params: dict[str, Any]) -> tuple | None: ...

    def close(self) -> None:
        """Release what the reads hold (connections); idempotent."""


class InlineReads:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def close(self) -> None:  # plain connections from the engine's pool: nothing of its own to release
        pass

    def first_now(self, stmt: Any, params: dict[str, Any]) -> tuple | None:
        with self.engine.connect() as conn:
            row = conn.execute(stmt, params).first()
        return None if row is None else tuple(row)

    async def first(self, stmt: Any, params: dict[str, Any]) -> tuple | None:
        return self.first_now(stmt, params)


class ThreadReads(InlineReads):
    async def first(self, stmt: Any, params: dict[str, Any]) -> tuple | None:
        return await asyncio.to_thread(self.first_now, stmt, params)


class PsycopgReads:
    """Up to ``size`` asyncio connections of psycopg per event loop (the registry's server has one; a
    call from another loop starts a fresh set). A connection that fails is dropped, not reused."""

    def __init__(self, engine: Engine, size: int = 4, connect_timeout: int = 5) -> None:
        url = engine.url
        self.dialect = engine.dialect
        self.connect_kwargs: dict[str, Any] = {
            **url.translate_connect_args(username="user", database="dbname"),
            **{k: v for k, v in url.query.items() if isinstance(v, str)},
            "connect_timeout": connect_timeout,
            "autocommit": True,
        }
        self.size = size
        self._compiled: dict[int, tuple[str, dict[str, Any]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: list[Any] = []
        self._slots: asyncio.Semaphore | None = None

    def _sql(self, stmt: Any) -> tuple[str, dict[str, Any]]:
        """The statement rendered once for this dialect (psycopg's %(name)s style) and its bound defaults."""
        hit = self._compiled.get(id(stmt))
        if hit is None:
            compiled = stmt.compile(dialect=self.dialect)
            hit = self._compiled[id(stmt)] = (str(compiled), dict(compiled.params))
        return hit

    def _for_this_loop(self, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
        if loop is not self._loop or self._slots is None:
            self.close()  # another loop's connections cannot be awaited here
            self._loop, self._slots = loop, asyncio.Semaphore(self.size)
        return self._slots

    async def first(self, stmt: Any, params: dict[str, Any]) -> tuple | None:
        import psycopg

        sql, defaults = self._sql(stmt)
        loop = asyncio.get_running_loop()
        async with self._for_this_loop(loop):
            conn = (
                self._idle.pop()
                if self._idle
                else await psycopg.AsyncConnection.connect(**self.connect_kwargs)
            )
            try:
                cur = await conn.execute(sql, {**defaults, **params})
                row = await cur.fetchone()
            except BaseException:
                _finish(conn)
                raise
            if loop is self._loop:  # kept for this loop's next read, unless another loop took over meanwhile
                self._idle.append(conn)
            else:
                _finish(conn)
        return None if row is None else tuple(row)

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            _finish(conn)


def _finish(conn: Any) -> None:
    """Close a psycopg connection without awaiting (libpq's PQfinish): safe from any thread or loop."""
    with contextlib.suppress(Exception):  # already closed or broken: nothing left to release
        conn.pgconn.finish()


def hot_reads_for(engine: Engine) -> HotReads:
    """The reads for ``engine``'s database (see the module's docstring)."""
    if engine.dialect.name == "sqlite":
        return InlineReads(engine)
    if engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg":
        return PsycopgReads(engine)
    return ThreadReads(engine)
