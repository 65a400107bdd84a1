"""Connection flags shared by every client command: bearer token and TLS/mTLS, each with an env twin."""

from __future__ import annotations

import argparse
import os

FLAGS = {  # dest -> (flag, environment variable, help)
    "token": ("--token", "LORASERVE_TOKEN", "bearer token"),
    "tls_ca": ("--tls-ca", "LORASERVE_TLS_CA", "PEM CA of the server's certificate (turns TLS on)"),
    "tls_cert": ("--tls-cert", "LORASERVE_TLS_CERT", "PEM client certificate, for mTLS"),
    "tls_key": ("--tls-key", "LORASERVE_TLS_KEY", "PEM key of --tls-cert"),
}


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    for dest, (flag, env, help_text) in FLAGS.items():
        parser.add_argument(flag, dest=dest, default=None, help=f"{help_text} (env {env})")


def connection_kwargs(args: argparse.Namespace) -> dict[str, str]:
    """``token``/``tls_*`` keyword arguments for Client, AsyncClient and RegistryClient."""
    return {dest: getattr(args, dest, None) or os.environ.get(env, "") for dest, (_, env, _) in FLAGS.items()}
