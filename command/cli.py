"""The ``loraserve`` command line: one entry point, one subcommand per job.

Subcommands are declared in ``COMMANDS`` as ``name -> "module:function"`` so that ``loraserve --help``
imports nothing heavy (JAX, SQLAlchemy): each subcommand's module is imported only when it runs.
Every subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.

Refusals, local (a pickle-only adapter folder, a bad flag value) or remote (any gRPC status from a server),
print one line ``error: CODE: message`` on stderr and exit with status 1, never a traceback. Exit statuses:
0 done; 1 refused (``error: CODE: …``; ``loraserve health`` also exits 1 for NOT_SERVING); 2 usage error
(argparse); 3 ``loraserve plan``: the configuration does not fit; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help). Each module defines add_arguments(parser) and run(args).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "loraserve.demo",
        "build a tiny model and adapters locally and serve them from a real worker",
    ),
    "adapters": ("loraserve.client.adapters_cmd", "push, list, show and delete adapters in the registry"),
    "workers": ("loraserve.client.workers_cmd", "list the workers registered with the registry"),
    "registry": (
        "loraserve.registry.cli",
        "run the adapter registry, migrate its database, collect orphan blobs",
    ),
    "router": ("loraserve.router.cli", "run the adapter-affinity router in front of the workers"),
    "generate": ("loraserve.client.generate_cmd", "stream a generation from a router or worker"),
    "worker": ("loraserve.worker.cli", "serve a base model with hot-swappable LoRA adapter slots (gRPC)"),
    "plan": (
        "loraserve.worker.plan_cmd",
        "will a model with these slots, batch and context fit N TPU chips? per-device bytes (exit 3: no)",
    ),
    "quantize": (
        "loraserve.worker.quantize_cmd",
        "write a checkpoint with int8 or int4 projections (and their scales) that workers load without quantizing",
    ),
    "health": ("loraserve.client.health_cmd", "probe a server's gRPC health (exit 0 when SERVING)"),
    "version": ("loraserve.version", "print the loraserve version and the versions of its runtime"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraserve",
        description="Serve many LoRA adapters on one base model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(sp)
    return parser


EXIT_REFUSED = 1
EXIT_INTERRUPTED = 130


def refusal_line(exc: BaseException) -> str:
    """``error: CODE: message`` for a ``LoraserveError`` or a ``grpc.RpcError``."""

    from loraserve.common.errors import LoraserveError, error_from_rpc

    err = exc if isinstance(exc, LoraserveError) else error_from_rpc(exc)  # type: ignore[arg-type]
    return f"error: {err.code_name}: {err.message}"


def main(argv: Sequence[str] | None = None) -> int:
    import grpc

    from loraserve.common.errors import LoraserveError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except (LoraserveError, grpc.RpcError) as exc:
        print(refusal_line(exc), file=sys.stderr, flush=True)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print("error: CANCELLED: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
