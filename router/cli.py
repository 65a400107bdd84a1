"""``loraserve router serve``: the adapter-affinity front door.

Every flag has an environment twin ``LORASERVE_ROUTER_<FLAG>`` (flags win); the logging flags' twins are
``LORASERVE_LOG_LEVEL`` and ``LORASERVE_LOG_FORMAT``, the same for every server (common.config). The options,
their help and their groups are the fields of ``router.config.RouterConfig``.
"""

from __future__ import annotations

import argparse
import asyncio

from loraserve.common.config import add_config_flags, add_logging_flags, config_from_args
from loraserve.router.config import ENV_PREFIX, RouterConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="router_command", metavar="ACTION")
    sub.required = True
    serve_parser = sub.add_parser("serve", help="serve Inference.Generate, proxied to the best worker")
    add_config_flags(serve_parser, RouterConfig, ENV_PREFIX)
    add_logging_flags(serve_parser)


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    from loraserve.common.addresses import serve_address
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
    services = router_services(
        locator, pool, config.max_concurrency, config.max_queued, config.max_queue_wait
    )
    background = []
    if config.http_port:
        from loraserve.httpapi import http_server
        from loraserve.router.http_backend import RouterHttpBackend

        backend = RouterHttpBackend(services.inference, locator)
        # /metrics leave through the metrics port when there is one (docs/security.md)
        http = http_server(
            backend, config.host, config.http_port, config.security(), metrics=not config.metrics_port
        )
        background.append(http.run)
    await run_server(
        services,
        serve_address(config.listen, config.host, config.port),
        config.security(),
        metrics_port=config.metrics_port,
        background=background,
        cleanup=[locator.close, pool.close],
        stop=stop,
    )


def run(args: argparse.Namespace) -> int:
    from loraserve.common.config import setup_logging_from_args

    setup_logging_from_args(args)
    asyncio.run(serve(config_from_args(RouterConfig, ENV_PREFIX, args)))
    return 0
