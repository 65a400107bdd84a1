"""embed_tokens and lm_head as LoRA targets: their per-slot pools and the model's per-row application.

PEFT adapts the input embedding with ``embed(x) + s · B_e · A_e[x]`` (``lora_embedding_A [r, vocab]``
gathered per token) and the output projection like any Linear, ``logits + s · (h A_l) B_l``. The pools
are vocabulary-sized and exist once per model, not per layer: ``LoraPools.vocab`` (``models.step``; the
slot write, the shardings and the donation treat them like every other pool), in the canonical layout
for every LoRA backend (no ``to_pool_layout``):

* ``A_embed [S, vocab, R]`` (rows gathered per token), ``B_embed [S, R, hidden]`` (scaling folded in);
* ``A_lm_head [S, hidden, R]``, ``B_lm_head [S, R, vocab]`` (scaling folded in).

Ranks below R are zero-padded (exact); a slot without these targets holds zeros. The model applies them
in XLA (a gather and two small matmuls per row, in f32), the same for every backend: the embedding delta
before Gemma's embedding scale (PEFT scales the LoRA output by the embedding's scale, transformers' Gemma 2
multiplies the sum: the same product), the lm_head delta before the final soft-cap. Rows without a slot
(−1) keep the base values bit for bit. Under tensor parallelism (``models.sharding.pool_specs``)
``A_embed`` is split by vocabulary like the embedding and ``B_lm_head`` like lm_head (when N divides the
vocabulary; replicated otherwise, as the weights are); ``B_embed`` and ``A_lm_head`` are whole. The ops
are plain XLA under GSPMD: each device's logits columns come from its own ``B_lm_head`` columns.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.adapters.peft import LoraWeights
from loraserve.models.config import ModelConfig

Array = jax.Array
VOCAB_POOLS = ("A_embed", "B_embed", "A_lm_head", "B_lm_head")


def is_vocab_pool(name: str) -> bool:
    return name in VOCAB_POOLS


def vocab_slot_shapes(cfg: ModelConfig, max_rank: int) -> dict[str, tuple[int, int]]:
    """Pool name -> one slot's matrix: ``A_embed [V, R]``, ``B_embed [R, H]``, ``A_lm_head [H, R]``,
    ``B_lm_head [R, V]``."""
    v, h, r = cfg.vocab_size, cfg.hidden_size, max_rank
    return {"A_embed": (v, r), "B_embed": (r, h), "A_lm_head": (h, r), "B_lm_head": (r, v)}


def init_vocab_pools(cfg: ModelConfig, num_slots: int, max_rank: int, dtype: Any) -> dict[str, Array]:
    """Zeroed ``[S, ...]`` pools of :func:`vocab_slot_shapes`. *Semantics:* no slot adapts embed/lm_head."""
    return {k: jnp.zeros((num_slots, *s), dtype) for k, s in vocab_slot_shapes(cfg, max_rank).items()}


def vocab_slot_values(cfg: ModelConfig, weights: LoraWeights, max_rank: int) -> dict[str, np.ndarray]:
    """One slot's host values of the four pools, rank zero-padded to ``max_rank``.

    *Semantics:* zeros for a target the adapter lacks (adds exactly nothing)."""
    out = {k: np.zeros(s, np.float32) for k, s in vocab_slot_shapes(cfg, max_rank).items()}
    for module, key in (("embed_tokens", "embed"), ("lm_head", "lm_head")):
        if module in weights.vocab:
            a, b = weights.vocab[module]
            out[f"A_{key}"][:, : a.shape[1]] = a
            out[f"B_{key}"][: b.shape[0]] = b
    return out


def _rows(slots: Array, num_slots: int) -> tuple[Array, Array]:
    valid = (slots >= 0) & (slots < num_slots)
    return valid, jnp.where(valid, slots, 0)


def apply_embed(
    h: Array,  # [G*k, H] the embedding rows (before any embedding scale)
    tokens: Array,  # [G*k] int32
    pools: dict[str, Array],  # LoraPools.vocab
    slots: Array,  # [G] int32 slot of each group of k consecutive rows; -1 = none
) -> Array:  # [G*k, H]
    """*Semantics:* rows of slot s get ``h + A_embed[s][token] · B_embed[s]`` (f32, rounded to h's dtype);
    rows without a slot get ``h`` exactly."""
    a_pool, b_pool = pools["A_embed"], pools["B_embed"]
    g = slots.shape[0]
    valid, take = _rows(slots, a_pool.shape[0])
    per_row = jnp.repeat(take, h.shape[0] // g, total_repeat_length=h.shape[0])  # [G*k]
    after_a = a_pool[per_row, tokens].astype(jnp.float32)  # [G*k, R]
    delta = jnp.einsum(
        "gkr,grh->gkh",
        after_a.reshape(g, -1, after_a.shape[-1]),
        b_pool[take].astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    out = (h.astype(jnp.float32).reshape(delta.shape) + delta).astype(h.dtype)
    return jnp.where(valid[:, None, None], out, h.reshape(out.shape)).reshape(h.shape)


def apply_lm_head(
    logits: Array,  # [G, V] f32, before any soft-cap
    x: Array,  # [G, H] the final-normed hidden state lm_head reads
    pools: dict[str, Array],  # LoraPools.vocab
    slots: Array,  # [G] int32; -1 = none
) -> Array:  # [G, V]
    """*Semantics:* row g of slot s gets ``logits + (x A_lm_head[s]) B_lm_head[s]`` (f32); rows without a
    slot get ``logits`` exactly.

    The vocabulary-sized ``B_lm_head`` rows are gathered only when some row's ``x A`` is non-zero (a slot
    without an lm_head LoRA holds zeros): otherwise the delta is exactly 0, and a decode step of adapters
    without one reads ``[G, H, R]`` of A instead of ``[G, R, V]`` of B (33 MB a step at batch 16, rank 16,
    vocab 32000).
    """
    a_pool, b_pool = pools["A_lm_head"], pools["B_lm_head"]
    valid, take = _rows(slots, a_pool.shape[0])
    hp = jax.lax.Precision.HIGHEST
    after_a = jnp.einsum("gh,ghr->gr", x.astype(jnp.float32), a_pool[take].astype(jnp.float32), precision=hp)
    after_a = jnp.where(valid[:, None], after_a, 0.0)

    def add(_: None) -> Array:
        delta = jnp.einsum("gr,grv->gv", after_a, b_pool[take].astype(jnp.float32), precision=hp)
        return jnp.where(valid[:, None], logits + delta.astype(logits.dtype), logits)

    return jax.lax.cond(jnp.any(after_a != 0), add, lambda _: logits, None)
