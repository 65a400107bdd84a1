"""bench/http_load.py, the overload benchmark's load generator, against a tiny in-process HTTP server that
answers 200 with a chunked (SSE-like) body or 429 with a JSON one: each request is read to its end on a
kept-alive connection, and the summary counts what the server sent."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import http_load


async def _serve(answers: list[int]):
    """A server answering the i-th request with ``answers[i % len]``; returns (server, port, connections)."""
    seen = {"requests": 0, "connections": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                status = answers[seen["requests"] % len(answers)]
                seen["requests"] += 1
                if status == 200:
                    chunks = [b"data: {}\n\n"] * 3 + [b"data: [DONE]\n\n"]
                    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body)
                else:
                    body = b'{"error": {}}'
                    writer.write(
                        b"HTTP/1.1 %d X\r\ncontent-length: %d\r\nretry-after: 1\r\n\r\n%s"
                        % (status, len(body), body)
                    )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def test_closed_and_open_loops_read_every_answer_to_its_end_on_kept_alive_connections() -> None:
    async def main():
        server, port, seen = await _serve([200, 429, 429])
        target = http_load.Target("127.0.0.1", port, "/v1/completions", {"model": "m", "prompt": [1, 2]})
        closed = await http_load.closed_loop(target, clients=4, seconds=0.3)
        opened = await http_load.open_loop(target, rate=200.0, seconds=0.3, seed=1)
        server.close()
        return closed, opened, seen

    closed, opened, seen = asyncio.run(main())
    assert len(closed) + len(opened) == seen["requests"]
    assert seen["connections"] < 4 + 16  # kept alive: 4 closed-loop clients, a few open-loop connections
    assert {s for s, _, _ in closed + opened} == {200, 429}
    summary = http_load.summarize(closed, 0.3)
    assert summary["served"] + summary["refused"] == len(closed) and summary["failed"] == 0
    assert summary["refused"] >= summary["served"]  # two 429s for every 200
    assert 0 < summary["refused_p50_ms"] <= summary["refused_p99_ms"] < 1000
    assert 40 <= len(opened) <= 110  # Poisson arrivals at 200/s for 0.3 s
