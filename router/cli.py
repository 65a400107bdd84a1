"""``loraserve router serve``: the adapter-affinity front door. Flags mirror ``LORASERVE_ROUTER_*``."""

from __future__ import annotations

import argparse
import asyncio
import signal
from dataclasses import fields

from loraserve.router.config import ENV_PREFIX, RouterConfig

HELP = {
    "registry": "registry host:port (LocateAdapter)",
    "host": "address to bind",
    "port": "port to bind (0 picks a free one)",
    "locate_ttl": "seconds a LocateAdapter answer is reused",
    "max_candidates": "workers tried, best first, before UNAVAILABLE",
    "metrics_port": "Prometheus /metrics port (0 = off)",
    "max_concurrency": "streams in flight; more get RESOURCE_EXHAUSTED at once",
    "auth_tokens": "comma-separated bearer tokens accepted for Generate (empty: no auth)",
    "admin_tokens": "comma-separated admin bearer tokens",
    "tls_cert": "PEM certificate: serve TLS",
    "tls_key": "PEM key of --tls-cert",
    "tls_client_ca": "PEM CA: require client certificates (mTLS)",
    "registry_token": "bearer token presented to the registry",
    "worker_token": "bearer token presented to the workers",
    "upstream_tls_ca": "PEM CA of the registry's and workers' certificates",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="router_command", metavar="ACTION")
    sub.required = True
    serve = sub.add_parser("serve", help="serve Inference.Generate, proxied to the best worker")
    for f in fields(RouterConfig):
        serve.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=None,
            help=f"{HELP[f.name]} (env {ENV_PREFIX + f.name.upper()}; default {f.default!r})",
        )
    serve.add_argument("--log-level", default="INFO")


async def serve(config: RouterConfig) -> None:
    from loraserve.common.observability import start_metrics
    from loraserve.common.security import ServerSecurity
    from loraserve.router.routing import Locator, WorkerPool
    from loraserve.router.server import build_server, set_serving

    start_metrics(config.metrics_port)
    locator = Locator(
        config.registry,
        config.locate_ttl,
        config.max_candidates,
        config.registry_token,
        config.upstream_tls_ca,
    )
    pool = WorkerPool(config.worker_token, config.upstream_tls_ca)
    security = ServerSecurity.from_strings(
        config.auth_tokens, config.admin_tokens, config.tls_cert, config.tls_key, config.tls_client_ca
    )
    server, port, health_servicer = build_server(
        locator, pool, f"{config.host}:{config.port}", security, config.max_concurrency
    )
    await server.start()
    await set_serving(health_servicer, True)
    print(f"loraserve router serving on {config.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await set_serving(health_servicer, False)
    await server.stop(grace=5)
    await locator.close()
    await pool.close()


def run(args: argparse.Namespace) -> int:
    from loraserve.common.observability import setup_logging

    setup_logging(args.log_level)
    config = RouterConfig.from_env(**{f.name: getattr(args, f.name) for f in fields(RouterConfig)})
    asyncio.run(serve(config))
    return 0
