"""``loraserve version``: what is installed."""

from __future__ import annotations

import argparse
import json
from importlib import metadata

PACKAGES = ("loraserve", "jax", "jaxlib", "grpcio", "protobuf", "sqlalchemy", "transformers")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def run(args: argparse.Namespace) -> int:
    found = versions()
    if args.json:
        print(json.dumps(found))
    else:
        for name, version in found.items():
            print(f"{name:14s} {version}")
    return 0
