"""Configuration from flags and environment: every server's config is a frozen dataclass whose fields have
``LORASERVE_<SERVER>_<FIELD>`` environment twins and ``--<field>`` flags (flags win over the environment,
the environment over the defaults). Bool values parse the same way from both: 1/true/yes/on are true.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import TypeVar

from loraserve.common.errors import InvalidArgument
from loraserve.common.security import ServerSecurity

T = TypeVar("T")


class ConfigError(InvalidArgument, ValueError):
    """A flag or environment value the config refuses (INVALID_ARGUMENT)."""


TRUE = ("1", "true", "yes", "on")


def parse_bool(value: str) -> bool:
    return value.strip().lower() in TRUE


def _coerce(value: str, kind: type) -> object:
    if kind is bool:
        return parse_bool(value)
    return kind(value)


def config_from_env(cls: type[T], prefix: str, env: dict[str, str] | None, overrides: dict[str, object]) -> T:
    """Build the frozen dataclass ``cls``: field defaults < ``<prefix><FIELD>`` variables < non-None overrides.

    Shared by the worker, registry and router configs.
    """
    env = dict(os.environ if env is None else env)
    values: dict[str, object] = {}
    for f in fields(cls):
        name = prefix + f.name.upper()
        raw = env.get(name)
        if raw is not None:
            try:
                values[f.name] = _coerce(raw, type(f.default))
            except ValueError as exc:
                raise ConfigError(f"{name}={raw!r}: {exc}") from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**values)
    except ValueError as exc:  # the dataclass's own validation
        raise ConfigError(str(exc)) from exc


def add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str,
    help_text: Mapping[str, str],
    only: Iterable[str] | None = None,
) -> None:
    """One ``--field-name`` flag per field of ``cls`` (or of ``only``), default None so the environment and the
    field default apply; the help names the environment twin and the default."""
    wanted = None if only is None else set(only)
    own = set(vars(cls).get("__annotations__", {}))  # own fields lead --help, inherited ones follow
    for f in sorted(fields(cls), key=lambda f: f.name not in own):
        if wanted is not None and f.name not in wanted:
            continue
        kind = type(f.default)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=parse_bool if kind is bool else kind,
            default=None,
            metavar=f.name.upper(),
            help=f"{help_text[f.name]} (env {prefix + f.name.upper()}; default {f.default!r})",
        )


def config_from_args(cls: type[T], prefix: str, args: argparse.Namespace) -> T:
    """The config the flags in ``args`` (those ``add_config_flags`` added) and the environment describe."""
    overrides = {f.name: getattr(args, f.name, None) for f in fields(cls)}
    return config_from_env(cls, prefix, None, overrides)


SECURITY_HELP = {
    "admin_tokens": "comma-separated bearer tokens accepted for every RPC (empty: no auth)",
    "worker_tokens": "comma-separated bearer tokens of workers: RegisterWorker, Heartbeat, GetAdapter,"
    " DownloadAdapter (docs/security.md)",
    "router_tokens": "comma-separated bearer tokens of routers: Generate, LocateAdapter, ListWorkers,"
    " ListAdapters (docs/security.md)",
    "tls_cert": "PEM certificate: serve TLS",
    "tls_key": "PEM key of --tls-cert",
    "tls_client_ca": "PEM CA: require client certificates (mTLS)",
    "auth_tokens": "comma-separated bearer tokens accepted for Inference.Generate (empty: no auth)",
}


@dataclass(frozen=True)
class ServerSecurityConfig:
    """The TLS and token fields every server reads (``LORASERVE_<SERVER>_ADMIN_TOKENS`` …). Each token list
    is a scope (common/security.py, docs/security.md); any token configured turns auth on."""

    admin_tokens: str = ""  # comma-separated tokens accepted for every RPC (empty: no auth)
    worker_tokens: str = ""  # comma-separated tokens of workers (register, heartbeat, fetch adapters)
    router_tokens: str = ""  # comma-separated tokens of routers (Generate, locate, list)
    tls_cert: str = ""  # PEM certificate: serve TLS
    tls_key: str = ""  # PEM key of tls_cert
    tls_client_ca: str = ""  # PEM CA: require client certificates (mTLS)

    def security(self) -> ServerSecurity:
        return ServerSecurity.from_strings(
            getattr(self, "auth_tokens", ""),
            self.admin_tokens,
            self.tls_cert,
            self.tls_key,
            self.tls_client_ca,
            self.worker_tokens,
            self.router_tokens,
        )


@dataclass(frozen=True)
class InferenceSecurityConfig(ServerSecurityConfig):
    """Servers that serve ``Inference.Generate`` (worker, router) also accept inference-only tokens."""

    auth_tokens: str = ""  # comma-separated tokens accepted for Generate (empty: no auth)
