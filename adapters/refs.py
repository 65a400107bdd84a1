"""Adapter references: ``name`` (the latest version) or ``name@3``; names match DESIGN.md §2's pattern."""

from __future__ import annotations

import re

from loraserve.adapters.errors import AdapterError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


def split_ref(ref: str) -> tuple[str, int | None]:
    """``"name@3" -> ("name", 3)``, ``"name" -> ("name", None)``; INVALID_ARGUMENT for a malformed ref."""
    name, sep, version = ref.partition("@")
    if not NAME_RE.match(name):
        raise AdapterError(f"adapter name {name[:64]!r} must match {NAME_RE.pattern}")
    if not sep:
        return name, None
    if not version.isdigit() or int(version) < 1:
        raise AdapterError(f"adapter version in {ref[:64]!r} must be a positive integer")
    return name, int(version)
