"""Weighted mixes of adapters per request (docs/design.md §10.5): mix refs and their validation.

A request may ask for ``Σ_k w_k · s_k · B_k A_k x`` instead of one adapter (``GenerateRequest.mix``). Inside
the worker a mix travels as one *mix ref* string, ``"a@1*0.7+b*0.3"`` (``+`` between parts, ``*`` before a
weight; neither can occur in an adapter name), so the scheduler, the slot table and the prefix cache treat it
like any other adapter. Once its parts are resolved the ref becomes a *mix key* of resolved versions
(``"a@1*0.7+b@2*0.3"``), which is what ``GenerateResponse.adapter`` reports.

*Weights in a mix ref* are written as Python's ``repr`` writes the float (the shortest text that reads back as
the same float) without an exponent's ``+``: ``1e16``, not ``1e+16``, which would split the part. So every
finite weight, ``-0.0`` and subnormals included, comes back from :func:`parse_mix` bit for bit. Hand-written
refs may still put a ``+`` in an exponent (``a*1e+2``) or before a weight (``a*+0.5``): :func:`parse_mix`
splits only on a ``+`` that starts a new part.

*Weights are bounded:* :func:`validate_mix` refuses a weight that is not finite or whose magnitude exceeds
``MAX_MIX_WEIGHT`` (100; INVALID_ARGUMENT naming the part). Task arithmetic uses weights around ±1; a weight in
the thousands is a typo or an overflow waiting to happen (it scales B inside the slot, whose pools may be
bfloat16), never a meaningful mix.

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
import re
from collections.abc import Sequence
from dataclasses import dataclass

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.refs import parse_ref

PART_SEP, WEIGHT_SEP = "+", "*"
DEFAULT_MAX_MIX = 4
MAX_MIX_WEIGHT = 100.0  # |weight| of any part, inclusive (module docstring)
# A `+` between parts: not an exponent's sign (`1e+16`, `2.E+3`) nor a weight's sign right after the `*`.
_PART_SPLIT = re.compile(r"(?<![0-9.][eE])(?<!\*)\+")


@dataclass(frozen=True)
class MixPart:
    ref: str  # "name", "name@3" or "name@alias"
    weight: float


def is_mix(ref: str) -> bool:
    """Whether ``ref`` is a mix ref (``"a*0.7+b*0.3"``) rather than one adapter's ref."""
    return WEIGHT_SEP in ref


def weight_text(weight: float) -> str:
    """``weight`` as a mix ref writes it: ``repr`` without an exponent's ``+`` (``1e16``); ``float()`` reads
    it back bit for bit for every finite float."""
    return repr(float(weight)).replace("e+", "e")


def mix_ref(parts: Sequence[MixPart]) -> str:
    """The mix ref of ``parts``: ``ref*weight`` joined by ``+``, weights by :func:`weight_text` (round trip)."""
    return PART_SEP.join(f"{p.ref}{WEIGHT_SEP}{weight_text(p.weight)}" for p in parts)


def parse_mix(ref: str) -> tuple[MixPart, ...]:
    """A mix ref -> its parts (not validated: :func:`validate_mix`); INVALID_ARGUMENT when malformed. Takes
    what :func:`mix_ref` writes and hand-written exponents with a ``+`` (``a*1e+2+b*0.5``)."""
    parts = []
    for item in _PART_SPLIT.split(ref):
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
    repeated ref, a weight that is NaN, infinite or beyond ±``MAX_MIX_WEIGHT``, or weights that are all zero
    (negative weights are allowed: task arithmetic subtracts an adapter)."""
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
        if not (math.isfinite(p.weight) and abs(p.weight) <= MAX_MIX_WEIGHT):
            raise AdapterError(
                f"mix weight of {p.ref[:64]!r} must be finite and within ±{MAX_MIX_WEIGHT:g}, got {p.weight!r}"
            )
    if all(p.weight == 0 for p in parts):
        raise AdapterError("mix weights are all zero")
