"""Configuration from flags and environment: every server's config is a frozen dataclass whose fields have
``LORASERVE_<SERVER>_<FIELD>`` environment twins."""

from __future__ import annotations

import os
from dataclasses import fields
from typing import TypeVar

T = TypeVar("T")


def _coerce(value: str, kind: type) -> object:
    if kind is bool:
        return value.strip().lower() in ("1", "true", "yes", "on")
    return kind(value)


def config_from_env(cls: type[T], prefix: str, env: dict[str, str] | None, overrides: dict[str, object]) -> T:
    """Build the frozen dataclass ``cls``: field defaults < ``<prefix><FIELD>`` variables < non-None overrides.

    Shared by the worker, registry and router configs.
    """
    env = dict(os.environ if env is None else env)
    values: dict[str, object] = {}
    for f in fields(cls):
        raw = env.get(prefix + f.name.upper())
        if raw is not None:
            values[f.name] = _coerce(raw, type(f.default))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)
