"""The one adapter a weighted mix is served as (``adapters.mixes`` holds the mix refs): PEFT's
``add_weighted_adapter(..., combination_type="cat")``. Only the worker imports this module (numpy); the router
and the SDK use ``adapters.mixes``, which the base install can import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from loraserve.adapters.errors import AdapterError, AdapterRankError
from loraserve.adapters.peft import LORA_MODULES, LoraWeights


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
