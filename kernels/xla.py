"""The ``xla`` backend: one-hot masked matmuls over all slots, which XLA fuses (TPU-style; see kernels.grouped for CPU decode).

Instead of gathering per-token weights (``A[idx]`` is ``[T, in, R]``), each token is multiplied
with *every* slot's matrix at once and the results of the slots it did not pick are masked out:

* shrink: ``hs = einsum("ti,sir->tsr", x, A)`` — one ``[T, in] × [in, S*R]`` matmul — then
  ``h[t] = Σ_s where(idx[t] == s, hs[t, s], 0)``.
* expand: ``hm[t, s] = where(idx[t] == s, h[t], 0)`` laid out as ``[T, S*R]``, then one matmul
  with ``B`` viewed as ``[S*R, out]`` (a free reshape).

This is what vLLM, tpu-inference and sglang-jax serve with on TPU. The cost is ``S×`` the flops of
a gathered matmul but it reads every weight exactly once and never materialises ``[T, in, R]``;
for decode batches it is memory bound and cheap. For long prefills grouped by adapter use
:mod:`kernels.sgmv`. Row isolation: the shrink selects (``where``) each row's own slot, and the expand
zeroes non-finite weights before the one matmul over all slots (where every row meets every slot's
``B``, mostly as ``0 × B``), so whatever one slot holds, even NaN, other rows' results are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from loraserve.kernels.shapes import (
    ACC_DTYPE,
    check_expand,
    check_shrink,
    expand_slices_generic,
    shrink_out_dtype,
    valid_rows,
)


def compute_dtype(a, b):
    """Operand dtype of a matmul of ``a`` and ``b``: theirs when equal, else f32 (never round down)."""
    return a.dtype if a.dtype == b.dtype else ACC_DTYPE


def one_hot_slots(idx, S: int):  # [T, S] bool
    """*Semantics:* ``m[t, s] = (idx[t] == s)``; tokens with idx outside ``[0, S)`` get an all-False row."""
    return idx[:, None] == jnp.arange(S, dtype=idx.dtype)[None, :]


def masked_shrink(x, W, member):  # [T, R] f32
    """``Σ_g where(member[t, g], x[t] @ W[g], 0)`` with W ``[G, in, R]`` and member ``[T, G]`` bool.

    Written as a batched matmul with the slot axis leading on both operands: the plain einsum
    ``ti,gir->tgr`` made XLA:CPU transpose all of W to ``[in, G*R]`` on every call, which cost more
    than the matmuls themselves (a 57 ms bench decode step fell to 41 ms with this form).
    """
    cd = compute_dtype(x, W)
    G = W.shape[0]
    xb = jnp.broadcast_to(x.astype(cd)[None], (G, *x.shape))  # [G, T, in]: batch dims lead on both sides
    hs = jax.lax.dot_general(xb, W.astype(cd), (((2,), (1,)), ((0,), (0,))), preferred_element_type=ACC_DTYPE)
    return jnp.where(member.T[:, :, None], hs, 0.0).sum(axis=0)  # [G, T, R] -> [T, R]


def finite_or_zero(W):
    """``W`` with every NaN/inf replaced by 0 (a select XLA fuses into the matmul that reads ``W``).

    *Semantics:* the weights a one-hot product may multiply by an exact 0: ``0 × inf`` and ``0 × NaN`` are
    NaN, so without it one slot's non-finite value would reach every row of the batch (row isolation,
    docs/security.md). Finite weights pass unchanged, so rows of healthy slots are bit for bit the same.
    """
    return jnp.where(jnp.isfinite(W), W, jnp.zeros((), W.dtype))


def masked_expand(h, W, member):  # [T, out] f32
    """``Σ_g where(member[t, g], h[t], 0) @ W[g]`` with W ``[G, R, out]`` and member ``[T, G]`` bool.

    The rows of the other groups meet ``W[g]`` as exact zeros; W's non-finite values are zeroed first
    (:func:`finite_or_zero`) so that a poisoned slot cannot turn those zeros into NaN.
    """
    T, R = h.shape
    G, _, d_out = W.shape
    cd = compute_dtype(h, W)
    hm = jnp.where(member[:, :, None], h[:, None, :].astype(cd), 0).reshape(T, G * R)  # [T, G*R]
    w = finite_or_zero(W).reshape(G * R, d_out).astype(cd)
    return jnp.dot(hm, w, preferred_element_type=ACC_DTYPE)


def lora_shrink(x, A, idx, *, out_dtype=None):  # [T, R]
    """One-hot LoRA shrink.

    Args:
      x:   ``[T, in]`` activations.
      A:   ``[S, in, R]`` down matrices of every slot.
      idx: ``[T]`` int slot per token; outside ``[0, S)`` (e.g. −1) = no adapter.
      out_dtype: dtype of the result (default: x's dtype). Accumulation is always f32.

    *Semantics:* ``h[t] = x[t] @ A[idx[t]]`` if ``idx[t]`` is a slot, else ``0``.
    """
    _, _, S, _ = check_shrink(x, A, idx)
    h = masked_shrink(x, A, one_hot_slots(idx, S))
    return h.astype(shrink_out_dtype(x, out_dtype))


def lora_expand(h, B, idx, y):  # [T, out]
    """One-hot LoRA expand into ``y``.

    Args:
      h:   ``[T, R]`` shrink results.
      B:   ``[S, R, out]`` up matrices of every slot.
      idx: ``[T]`` int slot per token.
      y:   ``[T, out]``; the result has y's dtype.

    *Semantics:* ``out[t] = y[t] + h[t] @ B[idx[t]]`` (f32, then cast); ``y[t]`` exactly when no adapter.
    """
    _, _, S, _ = check_expand(h, B, idx, y)
    d = masked_expand(h, B, one_hot_slots(idx, S))  # [T, out] f32
    out = (y.astype(ACC_DTYPE) + d).astype(y.dtype)
    return jnp.where(valid_rows(idx, S)[:, None], out, y)


def lora_expand_slices(h, Bs: Sequence, idx, y):  # [T, sum(out_i)]
    """Expand into the column slices of a fused projection.

    Args:
      h: ``[T, n*R]`` (slice i = columns ``i*R:(i+1)*R``); Bs: n × ``[S, R, out_i]``;
      idx: ``[T]``; y: ``[T, sum(out_i)]``.

    *Semantics:* ``out[:, off_i:off_i+out_i] = lora_expand(h[:, i*R:(i+1)*R], Bs[i], idx, y[:, off_i:…])``.
    """
    return expand_slices_generic(lora_expand, h, Bs, idx, y)


def add_lora(y, x, A, B, idx):  # [T, out]
    """Shrink + expand for one projection, rank-R intermediate kept in f32.

    *Semantics:* ``out[t] = y[t] + x[t] @ A[idx[t]] @ B[idx[t]]`` (``y[t]`` when no adapter).
    """
    return lora_expand(lora_shrink(x, A, idx, out_dtype=ACC_DTYPE), B, idx, y)


def add_lora_slices(y, x, A_cat, Bs: Sequence, idx):  # [T, sum(out_i)]
    """Fused-projection LoRA: A_cat ``[S, in, n*R]``, Bs n × ``[S, R, out_i]``, y ``[T, sum(out_i)]``.

    *Semantics:* slice i of the output gets ``x @ A_cat[slot][:, i*R:(i+1)*R] @ Bs[i][slot]``.
    """
    return lora_expand_slices(lora_shrink(x, A_cat, idx, out_dtype=ACC_DTYPE), Bs, idx, y)
