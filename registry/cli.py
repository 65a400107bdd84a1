"""``loraserve registry {serve,migrate,gc}``: run the registry, migrate its database, collect orphan blobs.

Every flag of ``serve`` (and of ``migrate`` and ``gc`` but ``--min-age-seconds``) has an environment twin
``LORASERVE_REGISTRY_<FLAG>`` (flags win); the logging flags' twins are ``LORASERVE_LOG_LEVEL`` and
``LORASERVE_LOG_FORMAT``, the same for every server (common.config). The options, their help and their
groups are the fields of ``registry.config.RegistryConfig``.
"""

from __future__ import annotations

import argparse
import asyncio

from loraserve.common.config import add_config_flags, add_logging_flags, config_from_args
from loraserve.registry.config import ENV_PREFIX, RegistryConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="registry_command", metavar="ACTION")
    sub.required = True
    serve = sub.add_parser("serve", help="serve AdapterRegistry and Placement over gRPC")
    add_config_flags(serve, RegistryConfig, ENV_PREFIX)
    add_logging_flags(serve)
    serve.set_defaults(registry_action=_serve)
    migrate = sub.add_parser("migrate", help="create or upgrade the database schema (Alembic)")
    add_config_flags(migrate, RegistryConfig, ENV_PREFIX, only=("db",))
    migrate.set_defaults(registry_action=_migrate)
    gc = sub.add_parser("gc", help="delete stored blobs that no adapter references")
    add_config_flags(gc, RegistryConfig, ENV_PREFIX, only=("db", "storage"))
    gc.add_argument(
        "--min-age-seconds",
        type=float,
        default=600.0,
        help="keep blobs younger than this (an upload in flight writes its blob before its row)",
    )
    gc.set_defaults(registry_action=_gc)


async def serve(config: RegistryConfig, stop: asyncio.Event | None = None) -> None:
    from loraserve.common.addresses import serve_address
    from loraserve.common.server import run_server
    from loraserve.registry.app import open_registry
    from loraserve.registry.server import expire_leases_forever, registry_services

    registry = open_registry(config)
    await run_server(
        registry_services(registry.catalog, registry.placement),
        serve_address(config.listen, config.host, config.port),
        config.security(),
        metrics_port=config.metrics_port,
        background=[
            lambda served: expire_leases_forever(registry.placement, max(0.5, config.lease_seconds / 3))
        ],
        cleanup=[registry.close],
        stop=stop,
    )


def _serve(config: RegistryConfig, args: argparse.Namespace) -> None:
    from loraserve.common.config import setup_logging_from_args

    setup_logging_from_args(args)
    asyncio.run(serve(config))


def _migrate(config: RegistryConfig, args: argparse.Namespace) -> None:
    from loraserve.registry.migrate import current_revision, upgrade

    upgrade(config.db)
    print(f"database at revision {current_revision(config.db)}")


def _gc(config: RegistryConfig, args: argparse.Namespace) -> None:
    from loraserve.registry.app import open_registry

    registry = open_registry(config)
    removed = registry.catalog.gc(min_age_s=args.min_age_seconds)
    registry.close()
    print(f"removed {len(removed)} unreferenced blob(s)")
    for digest in removed:
        print(f"  {digest}")


def run(args: argparse.Namespace) -> int:
    """Run the action argparse chose (``set_defaults(registry_action=...)``) with the configuration its flags
    and the environment give."""
    args.registry_action(config_from_args(RegistryConfig, ENV_PREFIX, args), args)
    return 0
