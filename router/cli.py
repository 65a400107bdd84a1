"""``loraserve router serve``: the adapter-affinity front door. Flags mirror ``LORASERVE_ROUTER_*``."""

from __future__ import annotations

import argparse
import asyncio

from loraserve.common.config import SECURITY_HELP, add_config_flags, config_from_args
from loraserve.router.config import ENV_PREFIX, RouterConfig

HELP = {
    "registry": "registry host:port (LocateAdapter)",
    "host": "address to bind",
    "port": "port to bind (0 picks a free one)",
    "locate_ttl": "seconds a LocateAdapter answer is reused",
    "max_candidates": "workers tried, best first, before UNAVAILABLE",
    "metrics_port": "Prometheus /metrics port (0 = off)",
    "http_port": "OpenAI-compatible HTTP API port, also serving /health, and /metrics when there is no"
    " --metrics-port (0 = off)",
    "max_concurrency": "streams in flight; more get RESOURCE_EXHAUSTED at once",
    **SECURITY_HELP,
    "registry_token": "bearer token presented to the registry",
    "worker_token": "bearer token presented to the workers",
    "upstream_tls_ca": "PEM CA of the registry's and workers' certificates",
    "worker_timeout": "seconds a call to a worker may last when the client set no deadline (0 = no limit)",
    "worker_first_token_timeout": "seconds to wait for a worker's first message before trying the next "
    "worker (0 = no limit)",
    "worker_stall_timeout": "seconds a worker may send nothing after its first message before the stream "
    "fails UNAVAILABLE (0 = no limit)",
    "upstream_keepalive": "seconds between keepalive pings to the registry and workers; a ping unanswered "
    "as long drops the connection (0 = off, else >= 5)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="router_command", metavar="ACTION")
    sub.required = True
    serve_parser = sub.add_parser("serve", help="serve Inference.Generate, proxied to the best worker")
    add_config_flags(serve_parser, RouterConfig, ENV_PREFIX, HELP)
    serve_parser.add_argument("--log-level", default="INFO")


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    from loraserve.common.server import run_server
    from loraserve.router.routing import Locator, WorkerPool
    from loraserve.router.server import router_services

    locator = Locator(
        config.registry,
        config.locate_ttl,
        config.max_candidates,
        config.registry_token,
        config.upstream_tls_ca,
        config.upstream_keepalive,
    )
    pool = WorkerPool(config.worker_token, config.upstream_tls_ca, config.worker_limits())
    services = router_services(locator, pool, config.max_concurrency)
    background = []
    if config.http_port:
        from loraserve.httpapi import http_server
        from loraserve.router.http import RouterHttpBackend

        backend = RouterHttpBackend(services.inference, locator)
        # /metrics leave through the metrics port when there is one (docs/security.md)
        http = http_server(
            backend, config.host, config.http_port, config.security(), metrics=not config.metrics_port
        )
        background.append(http.run)
    await run_server(
        services,
        config.host,
        config.port,
        config.security(),
        metrics_port=config.metrics_port,
        background=background,
        cleanup=[locator.close, pool.close],
        stop=stop,
    )


def run(args: argparse.Namespace) -> int:
    from loraserve.common.observability import setup_logging

    setup_logging(args.log_level)
    asyncio.run(serve(config_from_args(RouterConfig, ENV_PREFIX, args)))
    return 0
