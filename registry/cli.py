"""``loraserve registry {serve,migrate,gc}``: run the registry, migrate its database, collect orphan blobs.

Every flag has an environment twin ``LORASERVE_REGISTRY_<FLAG>`` (flags win).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from dataclasses import fields

from loraserve.registry.config import ENV_PREFIX, RegistryConfig

HELP = {
    "db": "SQLAlchemy URL of the database (SQLite file by default, postgresql+psycopg://… in production)",
    "storage": "fsspec root URL for adapter weights (a folder, memory://…, gs://bucket/prefix)",
    "host": "address to bind",
    "port": "port to bind (0 picks a free one)",
    "lease_seconds": "a worker that misses heartbeats this long loses its placements",
    "max_upload_bytes": "largest adapter weights file accepted",
    "max_lora_rank": "largest adapter rank accepted (the largest slot rank of the fleet)",
    "migrate": "run database migrations at start",
    "metrics_port": "Prometheus /metrics port (0 = off)",
    "admin_tokens": "comma-separated bearer tokens accepted for every RPC (empty: no auth)",
    "tls_cert": "PEM certificate: serve TLS",
    "tls_key": "PEM key of --tls-cert",
    "tls_client_ca": "PEM CA: require client certificates (mTLS)",
}


def _add_config_flags(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    for f in fields(RegistryConfig):
        if f.name not in names:
            continue
        env = ENV_PREFIX + f.name.upper()
        kind = type(f.default)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=(lambda v: v.lower() in ("1", "true", "yes", "on")) if kind is bool else kind,
            default=None,
            help=f"{HELP[f.name]} (env {env}; default {f.default!r})",
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="registry_command", metavar="ACTION")
    sub.required = True
    serve = sub.add_parser("serve", help="serve AdapterRegistry and Placement over gRPC")
    _add_config_flags(serve, tuple(f.name for f in fields(RegistryConfig)))
    serve.add_argument("--log-level", default="INFO")
    migrate = sub.add_parser("migrate", help="create or upgrade the database schema (Alembic)")
    _add_config_flags(migrate, ("db",))
    gc = sub.add_parser("gc", help="delete stored blobs that no adapter references")
    _add_config_flags(gc, ("db", "storage"))
    gc.add_argument(
        "--min-age-seconds",
        type=float,
        default=600.0,
        help="keep blobs younger than this (an upload in flight writes its blob before its row)",
    )


def _config(args: argparse.Namespace) -> RegistryConfig:
    overrides = {f.name: getattr(args, f.name, None) for f in fields(RegistryConfig)}
    return RegistryConfig.from_env(**overrides)


async def serve(config: RegistryConfig) -> None:
    from loraserve.common.observability import start_metrics
    from loraserve.common.security import ServerSecurity
    from loraserve.registry.app import open_registry
    from loraserve.registry.server import build_server, expire_leases_forever, set_serving

    registry = open_registry(config)
    start_metrics(config.metrics_port)
    security = ServerSecurity.from_strings(
        "", config.admin_tokens, config.tls_cert, config.tls_key, config.tls_client_ca
    )
    server, port, health_servicer = build_server(
        registry.catalog, registry.placement, f"{config.host}:{config.port}", security
    )
    await server.start()
    await set_serving(health_servicer, True)
    print(f"loraserve registry serving on {config.host}:{port}", flush=True)
    sweeper = asyncio.create_task(
        expire_leases_forever(registry.placement, max(0.5, config.lease_seconds / 3))
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await set_serving(health_servicer, False)
    sweeper.cancel()
    await server.stop(grace=5)
    registry.close()


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.registry_command == "serve":
        from loraserve.common.observability import setup_logging

        setup_logging(args.log_level)
        asyncio.run(serve(config))
    elif args.registry_command == "migrate":
        from loraserve.registry.migrate import current_revision, upgrade

        upgrade(config.db)
        print(f"database at revision {current_revision(config.db)}")
    elif args.registry_command == "gc":
        from loraserve.registry.app import open_registry

        registry = open_registry(config)
        removed = registry.catalog.gc(min_age_s=args.min_age_seconds)
        registry.close()
        print(f"removed {len(removed)} unreferenced blob(s)")
        for digest in removed:
            print(f"  {digest}")
    return 0
