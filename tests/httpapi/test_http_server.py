"""The HTTP server (``httpapi.server``) on its socket: a keep-alive connection is answered at once."""

from __future__ import annotations

import socket
import statistics
import time

from loraserve.httpapi.app import build_app
from tests.aio_thread import http_server_thread


def test_keep_alive_requests_are_answered_without_a_delayed_ack_stall() -> None:
    """Before the listening socket said IPPROTO_TCP, asyncio left Nagle on and every second request on a
    connection waited ~40 ms for the client's delayed ACK (uvicorn writes headers and body apart)."""

    class NoBackend:
        role = "worker"

    with http_server_thread(lambda: build_app(NoBackend())) as port:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        took = []
        with sock:
            for _ in range(15):
                t = time.perf_counter()
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                data = b""
                while b'"serving"}' not in data:
                    data += sock.recv(4096)
                took.append(time.perf_counter() - t)
    assert statistics.median(took[1:]) < 0.02, [round(t * 1000, 1) for t in took]
