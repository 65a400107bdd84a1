"""What every loraserve gRPC server shares: one build (interceptors, message limits, health, reflection, the
port) and one serve lifecycle, ``run_server``, used by the worker, registry and router CLIs.

Lifecycle: build the server with security and the ``StatusInterceptor``, bind, start with health
NOT_SERVING, run the optional warm-up, turn health SERVING, start the background tasks, print the ready line
``loraserve <role> serving on ADDRESS`` (``host:port`` with the port bound, or ``unix:/absolute/path``); on
SIGTERM/SIGINT (or ``stop``) turn health NOT_SERVING, cancel the background tasks, drain in-flight RPCs for
``grace`` seconds, remove the unix socket file (when serving on one), then run the cleanup callbacks in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraserve.common.addresses import (
    claim_unix_socket,
    parse_address,
    release_unix_socket,
    socket_file,
)
from loraserve.common.interceptors import StatusInterceptor
from loraserve.common.observability import start_metrics
from loraserve.common.security import ServerSecurity

log = logging.getLogger("loraserve.server")


@dataclass(frozen=True)
class Services:
    """What one server serves: ``role`` (metric label and ready line), ``add`` puts its servicers on a server,
    ``names`` are their full service names (health and reflection)."""

    role: str
    add: Callable[[grpc.aio.Server], None]
    names: tuple[str, ...]
    max_message_bytes: int | None = None
    inference: Any = None  # the Inference servicer, which the HTTP API calls in-process


# Clients ping idle connections to find a peer that stopped answering (the router's --upstream-keepalive). A
# gRPC server answers pings on a connection without calls, or more often than its minimum interval (hours by
# default), with GOAWAY ENHANCE_YOUR_CALM ("too_many_pings"). These servers accept pings with or without calls
# every PING_FLOOR_S; clients may ping every MIN_PING_INTERVAL_S or slower (a second of margin for jitter).
MIN_PING_INTERVAL_S = 5.0
PING_FLOOR_S = MIN_PING_INTERVAL_S - 1.0


def keepalive_server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(PING_FLOOR_S * 1000)),
    ]


def new_server(role: str, security: ServerSecurity, max_message_bytes: int | None = None) -> grpc.aio.Server:
    """A grpc.aio server whose outermost interceptor maps errors and records metrics, then auth."""
    options = keepalive_server_options()
    if max_message_bytes:
        options += [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
    return grpc.aio.server(interceptors=[StatusInterceptor(role), *security.interceptors()], options=options)


def build_server(
    services: Services, address: str, security: ServerSecurity | None = None
) -> tuple[grpc.aio.Server, int, Any]:
    """Servicers + health (NOT_SERVING until told otherwise) + reflection, bound to ``address``
    (``host:port``, or ``unix:PATH``: a socket file left there by a process that is gone is removed first, one
    a live process serves on refused with UNAVAILABLE; ``common.addresses``).

    Returns (server, bound port, health servicer); the server is not started.
    """
    security = security or ServerSecurity()
    server = new_server(services.role, security, services.max_message_bytes)
    services.add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*services.names, reflection.SERVICE_NAME, health.SERVICE_NAME), server
    )
    listen = parse_address(address, listen=True)
    if listen.unix:
        claim_unix_socket(listen.path)
    return server, security.add_port(server, str(listen)), health_servicer


async def set_health(health_servicer: Any, service_names: Sequence[str], serving: bool) -> None:
    state = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        await health_servicer.set(name, state)


def _report_crash(task: asyncio.Task) -> None:
    """A background task that dies (not cancelled at drain) is logged with its traceback, never silently lost."""
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed", task.get_coro(), exc_info=task.exception())


async def _call(fn: Callable[[], Any]) -> None:
    result = fn()
    if inspect.isawaitable(result):
        await result


async def run_server(
    services: Services,
    address: str,
    security: ServerSecurity,
    *,
    metrics_port: int = 0,
    warmup: Callable[[], Awaitable[None]] | None = None,
    background: Sequence[Callable[[str], Coroutine[Any, Any, None]]] = (),
    cleanup: Sequence[Callable[[], Any]] = (),
    grace: float = 5.0,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve ``services`` on ``address`` (``host:port``, port 0 = a free one, or ``unix:PATH``) until
    SIGTERM/SIGINT (main thread only) or ``stop`` is set, then drain.

    ``background`` coroutines get the address served on, as the ready line prints it (e.g. a worker advertises
    it), and are cancelled at drain; ``cleanup`` callbacks (sync or async) run after the server stopped, even
    when start-up failed. ``metrics_port`` 0 opens no metrics port.
    """
    try:
        start_metrics(metrics_port)
        listen = parse_address(address, listen=True)
        server, bound, health_servicer = build_server(services, str(listen), security)
        served = str(listen) if listen.unix else str(replace(listen, port=bound))
        socket_id = socket_file(listen.path) if listen.unix else None  # the file is there once bound
        await set_health(health_servicer, services.names, False)
        await server.start()
        tasks: list[asyncio.Task] = []
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        signals = (
            (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
        )
        for sig in signals:  # installed before warm-up: a SIGTERM while warming up skips straight to drain
            loop.add_signal_handler(sig, stop.set)
        try:
            if warmup is not None:
                log.info("%s bound to %s; warming up", services.role, served)
                await warmup()
            if not stop.is_set():
                await set_health(health_servicer, services.names, True)
                tasks = [asyncio.create_task(task(served)) for task in background]
                for t in tasks:
                    t.add_done_callback(_report_crash)
                print(f"loraserve {services.role} serving on {served}", flush=True)
                await stop.wait()
            log.info("%s draining", services.role)
        finally:
            await set_health(health_servicer, services.names, False)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await server.stop(grace=grace)
            if listen.unix:  # gRPC removes it too; this one is sure to leave another process's socket alone
                release_unix_socket(listen.path, socket_id)
            for sig in signals:
                loop.remove_signal_handler(sig)
    finally:
        for fn in cleanup:
            await _call(fn)
