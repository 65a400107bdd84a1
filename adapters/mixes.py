"""Weighted mixes of adapters per request (DESIGN.md §10.5): refs, validation, and the concatenated adapter.

A request may ask for ``Σ_k w_k · s_k · B_k A_k x`` instead of one adapter (``GenerateRequest.mix``). Inside
the worker a mix travels as one *mix ref* string, ``"a@1*0.7+b*0.3"`` (``+`` between parts, ``*`` before a
weight; neither can occur in an adapter name), so the scheduler, the slot table and the prefix cache treat it
like any other adapter. Once its parts are resolved the ref becomes a *mix key* of resolved versions
(``"a@1*0.7+b@2*0.3"``), which is what ``GenerateResponse.adapter`` reports.

The worker serves a mix as PEFT's ``add_weighted_adapter(..., combination_type="cat")`` builds it: one
adapter whose rank is the sum of the parts' ranks, ``A = [A_1 | A_2 | …]`` and ``B = [w_1 B_1; w_2 B_2; …]``
(scaling already folded into each B), written into a slot like any adapter. The batched kernels then add
exactly ``Σ_k w_k s_k B_k A_k x`` for that row in the same step as every other row, on every backend, and a
new mix is a slot write, never a compilation. Its cost is the parts' summed rank, so the sum must fit the
worker's ``max_lora_rank``. DoRA and ``lora_bias`` parts are refused: neither is linear in its weight (PEFT's
``cat`` drops their magnitudes and biases).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loraserve.adapters.errors import AdapterError, AdapterRankError
from loraserve.adapters.peft import LORA_MODULES, LoraWeights
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


def concat_adapters(parts: Sequence[tuple[str, LoraWeights, float]], max_rank: int) -> LoraWeights:
    """``(key, weights, w)`` per part -> the one adapter PEFT's ``cat`` combination builds.

    *Semantics:* per module (and embed_tokens / lm_head), ``A = concat_k A_k`` on the rank axis and
    ``B = concat_k w_k · B_k`` (``B_k`` carries its scaling), so ``x A B = Σ_k w_k s_k x A_k B_k``; a part
    that does not adapt a module adds nothing there. FAILED_PRECONDITION when a module's summed rank exceeds
    ``max_rank``; INVALID_ARGUMENT for a DoRA or ``lora_bias`` part or one key given twice.
    """
    keys = [key for key, _, _ in parts]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise AdapterError(f"a mix resolves to {twice[0]} twice")
    for key, w, _ in parts:
        if w.use_dora:
            raise AdapterError(f"{key} is a DoRA adapter; a mix takes LoRA adapters without DoRA")
        if w.biases:
            raise AdapterError(f"{key} has a lora_bias; a mix takes LoRA adapters without a bias")
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for m in LORA_MODULES:
        pieces = [(w.modules[m][0], w.modules[m][1] * np.float32(k)) for _, w, k in parts if m in w.modules]
        if pieces:
            modules[m] = (
                np.concatenate([a for a, _ in pieces], 2),
                np.concatenate([b for _, b in pieces], 1),
            )
    vocab: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for m in sorted({m for _, w, _ in parts for m in w.vocab}):
        pieces = [(w.vocab[m][0], w.vocab[m][1] * np.float32(k)) for _, w, k in parts if m in w.vocab]
        vocab[m] = (np.concatenate([a for a, _ in pieces], 1), np.concatenate([b for _, b in pieces], 0))
    ranks = {m: a.shape[2] for m, (a, _) in modules.items()} | {m: a.shape[1] for m, (a, _) in vocab.items()}
    too_big = {m: r for m, r in ranks.items() if r > max_rank}
    if too_big:
        module, rank = max(too_big.items(), key=lambda kv: kv[1])
        raise AdapterRankError(
            f"the mix's {module} has rank {rank} (the parts' ranks add up); the largest slot rank here is {max_rank}"
        )
    digest = hashlib.sha256(b"mix")
    for _, w, k in parts:
        digest.update(f"|{w.sha256}*{float(k)!r}".encode())
    return LoraWeights(
        rank=max(ranks.values()),
        alpha=float(max(ranks.values())),
        use_rslora=False,
        target_modules=tuple(m for m in LORA_MODULES if m in modules) + tuple(vocab),
        modules=modules,
        sha256=digest.hexdigest(),
        size_bytes=sum(w.size_bytes for _, w, _ in parts),
        config={"mix": [{"adapter": key, "weight": float(k)} for key, _, k in parts]},
        vocab=vocab,
    )
