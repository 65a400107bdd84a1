"""Adapter references: ``name`` (the latest version), ``name@3`` (a version) or ``name@prod`` (an alias the
registry resolves to one version, or to one of a weighted split); names match docs/design.md §2's pattern.
An alias starts with a letter, so it can never be mistaken for a version number."""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from loraserve.adapters.errors import AdapterError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
ALIAS_RE = re.compile(r"^[a-z][a-z0-9._-]{0,63}$")
VERSION_RE = re.compile(r"[0-9]{1,9}")  # a version fits the database's 32-bit integer column


@dataclass(frozen=True)
class Ref:
    name: str
    version: int | None = None
    alias: str | None = None


def parse_ref(ref: str) -> Ref:
    """``"name"``, ``"name@3"`` or ``"name@prod"``; INVALID_ARGUMENT for anything else."""
    name, sep, tail = ref.partition("@")
    if not NAME_RE.fullmatch(name):  # fullmatch: ``$`` alone also matches before a trailing newline
        raise AdapterError(f"adapter name {name[:64]!r} must match {NAME_RE.pattern}")
    if not sep:
        return Ref(name)
    if VERSION_RE.fullmatch(tail) and int(tail) >= 1:  # ASCII digits only ('²'.isdigit() is True)
        return Ref(name, version=int(tail))
    if ALIAS_RE.fullmatch(tail):
        return Ref(name, alias=tail)
    raise AdapterError(
        f"{ref[:64]!r}: after '@' comes a version (a positive integer of at most 9 digits) or an alias "
        f"matching {ALIAS_RE.pattern}"
    )


def split_ref(ref: str) -> tuple[str, int | None]:
    """``"name@3" -> ("name", 3)``, ``"name" -> ("name", None)``; INVALID_ARGUMENT for a malformed ref and for
    an alias (only the registry resolves those)."""
    parsed = parse_ref(ref)
    if parsed.alias is not None:
        raise AdapterError(f"{ref[:64]!r} names an alias, which only a registry resolves")
    return parsed.name, parsed.version


def pick_version(targets: Sequence[tuple[int, float]], routing_key: str = "") -> int:
    """One version of a weighted split: by ``routing_key`` when given (the same key always gets the same
    version while the split is unchanged, uniformly spread by sha256), else a random draw by weight."""
    total = sum(w for _, w in targets)
    if not targets or not math.isfinite(total) or total <= 0:
        raise AdapterError("an alias split needs weights with a positive total")
    if routing_key:
        u = int.from_bytes(hashlib.sha256(routing_key.encode()).digest()[:8], "big") / 2**64
    else:
        u = random.random()
    point, acc = u * total, 0.0
    for version, weight in targets:
        acc += weight
        if point < acc:
            return version
    return next(v for v, w in reversed(targets) if w > 0)


# A Hugging Face Hub repo id: "name" or "org/name". Anything else ("/x", "./x", "~/x", "a/b/c", "C:\\x") is a path.
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face repo id rather than a local path."""
    return bool(HUB_ID_RE.match(name))
