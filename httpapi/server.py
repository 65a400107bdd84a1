"""Serving the HTTP API with uvicorn in the gRPC server's own process and event loop.

The port is bound when the server is built (a taken port fails start-up with UNAVAILABLE, before warm-up),
and requests are served once the gRPC server is ready (``run`` is one of ``run_server``'s background tasks:
it starts after warm-up and is cancelled at drain, when uvicorn finishes the requests in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import Any

import uvicorn

from loraserve.common.errors import Unavailable
from loraserve.common.security import ServerSecurity

log = logging.getLogger("loraserve.http")


class CallContext:
    """The part of ``grpc.aio.ServicerContext`` the Generate servicers read, for calls made over HTTP."""

    def __init__(self, timeout: float | None = None) -> None:
        self._deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout

    def time_remaining(self) -> float | None:
        return (
            None if self._deadline is None else max(0.0, self._deadline - asyncio.get_running_loop().time())
        )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made as ``socket.create_server`` makes one but with ``IPPROTO_TCP`` as its protocol:
    asyncio sets TCP_NODELAY only on accepted sockets that say so, and without it a response written in two
    parts (uvicorn's headers, then body; every SSE chunk) waits for the client's delayed ACK (docs/performance.md)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot bind HTTP {host}:{port}: {exc}") from exc
    return sock


class HttpServer:
    """uvicorn on a socket bound at construction; ``port`` is the bound one (``0`` picks a free port)."""

    def __init__(
        self, app: Any, host: str, port: int, security: ServerSecurity | None = None, grace: float = 5.0
    ) -> None:
        security = security or ServerSecurity()
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        tls: dict[str, Any] = {}
        if security.tls_cert:  # the gRPC port's certificate serves HTTPS too (and mTLS with a client CA)
            tls = dict(ssl_certfile=security.tls_cert, ssl_keyfile=security.tls_key)
            if security.tls_client_ca:
                tls.update(ssl_ca_certs=security.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        self.scheme = "https" if tls else "http"
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=grace,
            **tls,
        )
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: (
            None
        )  # the gRPC server owns SIGTERM/SIGINT (older uvicorn)

    async def run(self, _grpc_address: str = "") -> None:
        """Serve until cancelled; then stop accepting, finish what is in flight and close the socket."""
        task = asyncio.ensure_future(self._serve())
        print(f"loraserve http on {self.scheme}://{self.host}:{self.port}", flush=True)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            self.server.should_exit = True
            with contextlib.suppress(Exception):
                await task
            raise
        finally:
            self.sock.close()

    async def _serve(self) -> None:
        # uvicorn >= 0.29 captures signals inside serve(); keep them with the gRPC server.
        capture = getattr(self.server, "capture_signals", None)
        if capture is not None:
            self.server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        await self.server.serve(sockets=[self.sock])
