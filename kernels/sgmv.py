"""Prefill path (SGMV-style): tokens come in contiguous runs ("segments"), one adapter per run.

A prefill batch packs the prompts of G requests back to back: segment g covers tokens
``[off_g, off_g + seg_lens[g])`` with ``off_g = seg_lens[0] + … + seg_lens[g-1]`` and uses slot
``seg_slots[g]`` (−1 = no adapter). Tokens after ``sum(seg_lens)`` (bucket padding) have no adapter;
lengths are clipped so that nothing runs past T. G is static (a bucket), the values are not, so a
new mix of prompts never recompiles.

Implementations (all return the same numbers as the per-token ops with :func:`segments_to_idx`):

* ``xla`` / ``method="masked"`` (default): gather the G segments' matrices (``A[seg_slots]`` is
  ``[G, in, R]``, cheap) and run the one-hot masked matmul over G groups instead of S slots —
  ``G/S`` of the per-token one-hot cost, exact, fast on CPU.
* ``xla`` / ``method="ragged"``: ``jax.lax.ragged_dot`` over the gathered per-segment matrices plus
  one zero group for the padding tail (the grouped-matmul primitive; on CPU it is lowered densely
  and is slower, on TPU/GPU XLA has a grouped kernel for it).
* ``reference`` / ``pallas``: expand the segments to per-token ids and call the per-token op; for
  Pallas contiguous segments mean each token block touches only one or two slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from loraserve.kernels import xla
from loraserve.kernels.shapes import (
    ACC_DTYPE,
    check_shrink,
    expand_slices_generic,
    operand_precision,
    shrink_out_dtype,
)

METHODS = ("masked", "ragged")


def _check_segments(seg_slots, seg_lens) -> int:
    if seg_slots.ndim != 1 or seg_slots.shape != seg_lens.shape:
        raise ValueError(f"seg_slots {seg_slots.shape} and seg_lens {seg_lens.shape} must both be [G]")
    if not (jnp.issubdtype(seg_slots.dtype, jnp.integer) and jnp.issubdtype(seg_lens.dtype, jnp.integer)):
        raise ValueError("seg_slots and seg_lens must be integer arrays")
    return seg_slots.shape[0]


def segment_ends(seg_lens, T: int):  # [G] int32
    """*Semantics:* ``ends[g] = min(T, seg_lens[0] + … + seg_lens[g])`` (negative lengths count as 0)."""
    return jnp.minimum(jnp.cumsum(jnp.maximum(seg_lens, 0).astype(jnp.int32)), T)


def segment_of_token(seg_lens, T: int):  # [T] int32 in [0, G]
    """*Semantics:* the segment each token falls in; ``G`` for tokens after the last segment."""
    return jnp.searchsorted(segment_ends(seg_lens, T), jnp.arange(T, dtype=jnp.int32), side="right").astype(
        jnp.int32
    )


def segments_to_idx(seg_slots, seg_lens, T: int):  # [T] int32
    """Per-token slot ids of a segment layout.

    Args:
      seg_slots: ``[G]`` int slot of each segment, −1 = no adapter.
      seg_lens:  ``[G]`` int number of tokens of each segment.
      T: number of tokens (static).

    *Semantics:* ``idx[t] = seg_slots[g]`` for t in segment g, −1 after the last segment.
    """
    G = _check_segments(seg_slots, seg_lens)
    seg = segment_of_token(seg_lens, T)
    return jnp.where(seg < G, seg_slots[jnp.minimum(seg, G - 1)], -1).astype(jnp.int32)


def _members(seg_slots, seg_lens, T: int, S: int):  # [T, G] bool
    """``m[t, g]``: token t is in segment g and that segment has a real slot."""
    G = _check_segments(seg_slots, seg_lens)
    has_slot = (seg_slots >= 0) & (seg_slots < S)  # [G]
    seg = segment_of_token(seg_lens, T)
    return (seg[:, None] == jnp.arange(G, dtype=jnp.int32)[None, :]) & has_slot[None, :]


def _gather_segments(W, seg_slots):  # [G, ...] with zeros for segments without a slot
    S = W.shape[0]
    g = W[jnp.clip(seg_slots, 0, S - 1)]
    has_slot = (seg_slots >= 0) & (seg_slots < S)
    return jnp.where(has_slot.reshape((-1,) + (1,) * (W.ndim - 1)), g, 0)


def _ragged_sizes(seg_lens, T: int):  # [G+1] int32, sums to T
    ends = segment_ends(seg_lens, T)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return jnp.concatenate([ends - starts, (T - ends[-1:]).astype(jnp.int32)])


def _ragged(lhs, W, seg_slots, seg_lens):  # [T, n] f32
    T = lhs.shape[0]
    Wg = _gather_segments(W, seg_slots)  # [G, k, n]
    Wg = jnp.concatenate([Wg, jnp.zeros((1, *Wg.shape[1:]), Wg.dtype)])  # + the padding tail's group
    cd = xla.compute_dtype(lhs, W)
    lhs, Wg = lhs.astype(cd), Wg.astype(cd)
    sizes = _ragged_sizes(seg_lens, T)
    return lax.ragged_dot(
        lhs, Wg, sizes, precision=operand_precision(lhs, Wg), preferred_element_type=ACC_DTYPE
    )


def _token_ids(T: int):
    """A shape-only stand-in for per-token ids, for the shared shape checks."""
    return jax.ShapeDtypeStruct((T,), jnp.int32)


def _method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown sgmv method {method!r}; expected one of {METHODS}")
    return method


def xla_shrink_sgmv(x, A, seg_slots, seg_lens, *, out_dtype=None, method: str = "masked"):  # [T, R]
    """Segment LoRA shrink with XLA ops.

    Args:
      x: ``[T, in]``; A: ``[S, in, R]``; seg_slots, seg_lens: ``[G]`` int (see the module docstring).

    *Semantics:* ``h[t] = x[t] @ A[seg_slots[g]]`` for t in segment g with a slot, else 0.
    """
    T, _, S, _ = check_shrink(x, A, _token_ids(x.shape[0]))
    if _method(method) == "ragged":
        h = _ragged(x, A, seg_slots, seg_lens)
    else:
        h = xla.masked_shrink(x, _gather_segments(A, seg_slots), _members(seg_slots, seg_lens, T, S))
    return h.astype(shrink_out_dtype(x, out_dtype))


def xla_expand_sgmv(h, B, seg_slots, seg_lens, y, *, method: str = "masked"):  # [T, out]
    """Segment LoRA expand into y with XLA ops.

    Args:
      h: ``[T, R]``; B: ``[S, R, out]``; seg_slots, seg_lens: ``[G]`` int; y: ``[T, out]``.

    *Semantics:* ``out[t] = y[t] + h[t] @ B[seg_slots[g]]`` for t in segment g with a slot, else ``y[t]``.
    """
    T = h.shape[0]
    S = B.shape[0]
    if B.ndim != 3 or B.shape[1] != h.shape[1] or y.shape != (T, B.shape[2]):
        raise ValueError(f"expected h [T, R], B [S, R, out], y [T, out]; got {h.shape}, {B.shape}, {y.shape}")
    member = _members(seg_slots, seg_lens, T, S)  # [T, G]
    if _method(method) == "ragged":
        d = _ragged(h, B, seg_slots, seg_lens)
    else:
        d = xla.masked_expand(h, _gather_segments(B, seg_slots), member)
    out = (y.astype(ACC_DTYPE) + d).astype(y.dtype)
    return jnp.where(member.any(axis=1)[:, None], out, y)


def xla_expand_slices_sgmv(h, Bs: Sequence, seg_slots, seg_lens, y, *, method: str = "masked"):
    """Segment expand into the column slices of a fused projection (h ``[T, n*R]``, Bs n × ``[S, R, out_i]``).

    *Semantics:* slice i of y gets ``xla_expand_sgmv(h[:, i*R:(i+1)*R], Bs[i], …)``.
    """

    def one(h_i, B_i, _idx, y_i):
        return xla_expand_sgmv(h_i, B_i, seg_slots, seg_lens, y_i, method=method)

    return expand_slices_generic(one, h, Bs, _token_ids(h.shape[0]), y)


def xla_add_lora_slices_one_slot(y, x, A_cat, Bs: Sequence, slot):  # [T, sum(out_i)]
    """Every token of one prompt with the adapter in ``slot`` (prefill of one request), docs/design.md §6 pools.

    Args:
      y: ``[T, sum(out_i)]``; x: ``[T, in]``; A_cat: ``[S, in, n*R]``; Bs: n × ``[S, R, out_i]``;
      slot: ``[]`` int, −1 = no adapter.

    Gathers the one slot's matrices (``[1, in, n*R]``, cheap) and runs the masked SGMV over that one
    segment of all T tokens: ``1/S`` of the per-token one-hot's work.

    *Semantics:* ``y + x @ A_cat[slot][:, i*R:(i+1)*R] @ Bs[i][slot]`` per slice i; ``y`` when slot is −1.
    """
    take = jnp.maximum(slot, 0)
    seg_lens = jnp.reshape(x.shape[0], (1,)).astype(jnp.int32)
    seg_slots = jnp.where(slot >= 0, 0, -1).reshape(1)
    a_one = lax.dynamic_index_in_dim(A_cat, take, axis=0, keepdims=True)  # [1, in, n*R]
    bs_one = tuple(lax.dynamic_index_in_dim(B, take, axis=0, keepdims=True) for B in Bs)
    h = xla_shrink_sgmv(x, a_one, seg_slots, seg_lens, out_dtype=ACC_DTYPE)
    return xla_expand_slices_sgmv(h, bs_one, seg_slots, seg_lens, y)
