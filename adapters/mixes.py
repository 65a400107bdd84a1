"""Weighted mixes of adapters per request (DESIGN.md §10.5): mix refs and their validation.

A request may ask for ``Σ_k w_k · s_k · B_k A_k x`` instead of one adapter (``GenerateRequest.mix``). Inside
the worker a mix travels as one *mix ref* string, ``"a@1*0.7+b*0.3"`` (``+`` between parts, ``*`` before a
weight; neither can occur in an adapter name), so the scheduler, the slot table and the prefix cache treat it
like any other adapter. Once its parts are resolved the ref becomes a *mix key* of resolved versions
(``"a@1*0.7+b@2*0.3"``), which is what ``GenerateResponse.adapter`` reports.

The worker serves a mix as PEFT's ``add_weighted_adapter(..., combination_type="cat")`` builds it
(``adapters.mix_weights.concat_adapters``): one adapter whose rank is the sum of the parts' ranks,
``A = [A_1 | A_2 | …]`` and ``B = [w_1 B_1; w_2 B_2; …]`` (scaling already folded into each B), written into a
slot like any adapter. The batched kernels then add exactly ``Σ_k w_k s_k B_k A_k x`` for that row in the same
step as every other row, on every backend, and a new mix is a slot write, never a compilation. Its cost is
the parts' summed rank, so the sum must fit the worker's ``max_lora_rank``. DoRA and ``lora_bias`` parts are
refused: neither is linear in its weight (PEFT's ``cat`` drops their magnitudes and biases).

This module imports no numpy: the router (base install) parses and validates mixes with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.refs import parse_ref

PART_SEP, WEIGHT_SEP = "+", "*"
DEFAULT_MAX_MIX = 4


@dataclass(frozen=True)
class MixPart:
    ref: str  # "name", "name@3" or "name@alias"
    weight: float


def is_mix(ref: str) -> bool:
    """Whether ``ref`` is a mix ref (``"a*0.7+b*0.3"``) rather than one adapter's ref."""
    return WEIGHT_SEP in ref


def mix_ref(parts: Sequence[MixPart]) -> str:
    """The mix ref of ``parts``: ``ref*weight`` joined by ``+``, weights as Python prints them (round trip)."""
    return PART_SEP.join(f"{p.ref}{WEIGHT_SEP}{float(p.weight)!r}" for p in parts)


def parse_mix(ref: str) -> tuple[MixPart, ...]:
    """A mix ref -> its parts (not validated: :func:`validate_mix`); INVALID_ARGUMENT when malformed."""
    parts = []
    for item in ref.split(PART_SEP):
        name, sep, weight = item.rpartition(WEIGHT_SEP)
        if not sep:
            raise AdapterError(f"mix part {item[:64]!r} has no weight (expected adapter*weight)")
        try:
            parts.append(MixPart(name, float(weight)))
        except ValueError:
            raise AdapterError(f"mix part {item[:64]!r}: the weight is not a number") from None
    return tuple(parts)


def validate_mix(parts: Sequence[MixPart], max_mix: int) -> None:
    """INVALID_ARGUMENT for a mix the worker will not serve: no parts or more than ``max_mix``, a malformed or
    repeated ref, a NaN or infinite weight, or weights that are all zero (negative weights are allowed: task
    arithmetic subtracts an adapter)."""
    if not parts:
        raise AdapterError("a mix needs at least one adapter")
    if len(parts) > max_mix:
        raise AdapterError(
            f"a mix has {len(parts)} adapters; this server allows at most {max_mix} (--max-mix)"
        )
    seen: set[str] = set()
    for p in parts:
        if not p.ref:
            raise AdapterError("a mix part names no adapter")
        parse_ref(p.ref)
        if p.ref in seen:
            raise AdapterError(f"a mix names {p.ref[:64]!r} twice")
        seen.add(p.ref)
        if not math.isfinite(p.weight):
            raise AdapterError(f"mix weight of {p.ref[:64]!r} must be finite, got {p.weight}")
    if all(p.weight == 0 for p in parts):
        raise AdapterError("mix weights are all zero")
