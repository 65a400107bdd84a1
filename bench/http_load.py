"""A lean HTTP/1.1 load generator for the overload benchmark: raw asyncio streams, keep-alive connections.

A Python load generator on the machine it measures takes CPU from the servers it measures: httpx at 512
concurrent clients burned 1.35 of this machine's 2 cores and reported its own event loop's lag as the
servers' latency (a 429 decided in milliseconds arrived "after 7 s"). This one writes each request as bytes
prepared once and reads just enough of the response to know its status and end (Content-Length or chunked,
the SSE stream of a served completion): tens of microseconds of its own work per request.

``closed_loop``: ``clients`` connections each send a request as soon as the previous one ended (guidellm's
"throughput" step, a client that ignores Retry-After). ``open_loop``: Poisson arrivals at ``rate`` per second
whatever happens to earlier ones (connections reused when idle, opened when none is). Both return one
``(status, seconds, ended_at)`` per request; status 0 is a connection that failed.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    path: str
    body: dict

    def request(self) -> bytes:
        payload = json.dumps(self.body).encode()
        head = (
            f"POST {self.path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        )
        return head.encode() + payload


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> int:
    """One request on an open connection; returns the status once the whole response was read."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if b":" in line:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return status


async def closed_loop(target: Target, clients: int, seconds: float) -> list[tuple[int, float, float]]:
    request = target.request()
    results: list[tuple[int, float, float]] = []
    stop = time.perf_counter() + seconds

    async def client() -> None:
        conn = None
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = await asyncio.open_connection(target.host, target.port)
                status = await _exchange(*conn, request)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                status, conn = 0, None
            t1 = time.perf_counter()
            results.append((status, t1 - t0, t1))
        if conn is not None:
            conn[1].close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return results


async def open_loop(
    target: Target, rate: float, seconds: float, seed: int = 0, max_connections: int = 2048
) -> list[tuple[int, float, float]]:
    request = target.request()
    results: list[tuple[int, float, float]] = []
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    rng = random.Random(seed)
    tasks = set()
    opened = 0

    async def one(t0: float) -> None:
        nonlocal opened
        conn = idle.pop() if idle else None
        try:
            if conn is None:
                if opened >= max_connections:
                    raise OSError("connection limit")
                opened += 1
                conn = await asyncio.open_connection(target.host, target.port)
            status = await _exchange(*conn, request)
            idle.append(conn)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            status = 0
            if conn is not None:
                conn[1].close()
                opened -= 1
        t1 = time.perf_counter()
        results.append((status, t1 - t0, t1))

    start = time.perf_counter()
    at = start
    while at - start < seconds:
        at += rng.expovariate(rate)
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.ensure_future(one(at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=120)
    for _, writer in idle:
        writer.close()
    return results


def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(results: list[tuple[int, float, float]], seconds: float) -> dict:
    """Served requests per second (status 200), refusals (429) and their latency p50/p99 in ms, others."""
    ok = [s for st, s, _ in results if st == 200]
    refused = [s for st, s, _ in results if st == 429]
    ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
    return dict(
        served_rps=round(len(ok) / seconds, 2),
        served=len(ok),
        refused=len(refused),
        failed=len(results) - len(ok) - len(refused),
        failed_statuses=sorted({st for st, _, _ in results if st not in (200, 429)}),
        refused_p50_ms=ms(quantile(refused, 0.5)),
        refused_p99_ms=ms(quantile(refused, 0.99)),
        served_p50_s=None if not ok else round(quantile(ok, 0.5), 3),
        served_p99_s=None if not ok else round(quantile(ok, 0.99), 3),
    )
