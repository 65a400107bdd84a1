"""Speculative decoding's verify step on the device: which drafted tokens a row keeps (docs/speculative.md).

A row verifies ``L = k + 1`` positions in one step: its last token and the ``k`` tokens a drafter proposed
(``engine.speculative``). The model's logits at position i predict the token after input i, so position i
judges draft ``d_i`` and the row emits the drafts it keeps plus one token of the target's own:

* **greedy rows** (temperature 0) keep the longest prefix of drafts equal to the target's argmax at their
  positions, then the argmax after it: exactly the tokens plain decoding would give.
* **sampled rows** keep ``d_i`` with probability ``p_i(d_i)`` (``p_i``: the target's distribution at position
  i after temperature, top-k and top-p), the standard rejection rule for a draft that is a point mass
  (n-gram drafts are); at the first rejection the row draws from ``p_i`` without ``d_i`` (the residual
  ``max(0, p - q)`` renormalised), and a row that keeps all k draws its next token from ``p_k``. Each emitted
  token is distributed as ``p_i``: ``p(d)·[x = d] + (1 − p(d))·p(x)/(1 − p(d))·[x ≠ d] = p(x)``.

Randomness is keyed like ``models.sampling``'s: (seed, the row's output index of the position), one stream
for the acceptance draws and one for the tokens, so a seeded request is reproducible.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from loraserve.kernels.linear import argmax_last
from loraserve.models.sampling import filter_top_k_top_p

Array = jax.Array
_ACCEPT = 0x5EC  # folded into an acceptance draw's key: a stream apart from the token draws'


class Verified(NamedTuple):
    """What a verify step gives each row: ``accepted [G]`` drafts kept (0..k) and ``tokens [G, L]`` whose
    first ``accepted + 1`` entries are emitted (the kept drafts, then the target's token)."""

    accepted: Array
    tokens: Array


def verify(
    logits: Array,
    drafts: Array,
    draft_lens: Array,
    temperature: Array,
    top_k: Array,
    top_p: Array,
    seed_lo: Array,
    seed_hi: Array,
    step: Array,
) -> Verified:
    """logits ``[G, L, V]`` f32 (position i after input i; L = k + 1), drafts ``[G, k]`` int32 with
    ``draft_lens [G]`` of them real (0 = a row that does not speculate: it emits one token, as a decode step
    does), the rows' sampling parameters ``[G]`` and ``step [G]``, the output index of each row's position 0.

    *Semantics:* the module docstring's rules; draft entries at or past ``draft_lens`` are never kept.
    """
    g, length, vocab = logits.shape
    k = length - 1
    flat = logits.reshape(g * length, vocab)
    greedy = argmax_last(flat).reshape(g, length)
    positions = jnp.arange(length, dtype=jnp.int32)
    drafted = positions[None, :k] < draft_lens[:, None]  # [G, k]

    def sampled() -> tuple[Array, Array]:
        t = jnp.where(temperature > 0, temperature, 1.0)
        scaled = flat / jnp.repeat(t, length)[:, None]
        scaled = filter_top_k_top_p(scaled, jnp.repeat(top_k, length), jnp.repeat(top_p, length))
        logp = jax.nn.log_softmax(scaled, axis=-1).reshape(g, length, vocab)
        p_draft = jnp.exp(jnp.take_along_axis(logp[:, :k], drafts[:, :, None], axis=-1)[..., 0])  # [G, k]
        index = step[:, None] + positions[None, :]  # [G, L]: each position's output index

        def key(lo: Array, hi: Array, n: Array, salt: int) -> Array:
            base = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), lo), hi)
            return jax.random.fold_in(jax.random.fold_in(base, n), salt)

        keys = jax.vmap(jax.vmap(key, (None, None, 0, None)), (0, 0, 0, None))
        u = jax.vmap(jax.vmap(jax.random.uniform))(keys(seed_lo, seed_hi, index, _ACCEPT))  # [G, L]
        keep = u[:, :k] < p_draft
        # the token drawn at each position: from p_i without d_i where a draft stands there (the residual
        # after a rejection), else from p_i itself (a bonus after every draft was kept)
        banned = jnp.where(positions[None, :k] < draft_lens[:, None], drafts, -1)
        banned = jnp.concatenate([banned, jnp.full((g, 1), -1, banned.dtype)], axis=1)  # [G, L]
        residual = jnp.where(jnp.arange(vocab)[None, None, :] == banned[:, :, None], -jnp.inf, logp)
        # a draft that held all the mass (p = 1) leaves no residual: it is always kept, never redrawn
        residual = jnp.where(jnp.isfinite(residual).any(-1, keepdims=True), residual, logp)
        draw = jax.vmap(jax.vmap(lambda kk, lg: jax.random.categorical(kk, lg).astype(jnp.int32)))
        drawn = draw(keys(seed_lo, seed_hi, index, 0), residual)  # [G, L]
        return keep, drawn

    def greedy_only() -> tuple[Array, Array]:
        return greedy[:, :k] == drafts, greedy

    keep_s, drawn = jax.lax.cond(jnp.any(temperature > 0), sampled, greedy_only)
    is_greedy = (temperature <= 0)[:, None]
    keep = jnp.where(is_greedy, greedy[:, :k] == drafts, keep_s) & drafted
    own = jnp.where(is_greedy, greedy, drawn)  # [G, L]: the target's token at each position
    accepted = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # [G]
    # emitted: drafts before the first rejection, then the target's own token at that position
    tokens = jnp.where(positions[None, :] < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), own)
    return Verified(accepted, tokens.astype(jnp.int32))
