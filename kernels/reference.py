"""The ``reference`` backend: per-token gather of the adapter matrices, then a batched matmul.

This is the truth every other backend is tested against. It is deliberately simple and exact
(f32 math at ``Precision.HIGHEST``), not fast: gathering ``A[idx]`` materialises a
``[T, in, R]`` array, so do not serve long prefills with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax

from loraserve.kernels.shapes import (
    ACC_DTYPE,
    check_expand,
    check_shrink,
    expand_slices_generic,
    shrink_out_dtype,
    valid_rows,
)

_HI = lax.Precision.HIGHEST


def lora_shrink(x, A, idx, *, out_dtype=None):  # [T, R]
    """LoRA shrink for a batch of tokens that each pick their own adapter slot.

    Args:
      x:   ``[T, in]`` activations.
      A:   ``[S, in, R]`` down matrices of every slot.
      idx: ``[T]`` int slot per token; outside ``[0, S)`` (e.g. −1) = no adapter.
      out_dtype: dtype of the result (default: x's dtype). Accumulation is always f32.

    *Semantics:* ``h[t] = x[t] @ A[idx[t]]`` if ``idx[t]`` is a slot, else ``0``.
    """
    _, _, S, _ = check_shrink(x, A, idx)
    valid = valid_rows(idx, S)  # [T]
    a_tok = A[jnp.clip(idx, 0, S - 1)]  # [T, in, R]
    h = jnp.einsum("ti,tir->tr", x.astype(ACC_DTYPE), a_tok.astype(ACC_DTYPE), precision=_HI)
    h = jnp.where(valid[:, None], h, 0.0)  # [T, R]
    return h.astype(shrink_out_dtype(x, out_dtype))


def lora_expand(h, B, idx, y):  # [T, out]
    """LoRA expand: add each token's ``h @ B[slot]`` into ``y``.

    Args:
      h:   ``[T, R]`` shrink results.
      B:   ``[S, R, out]`` up matrices of every slot.
      idx: ``[T]`` int slot per token; outside ``[0, S)`` = no adapter.
      y:   ``[T, out]`` the base projection output; the result has y's dtype.

    *Semantics:* ``out[t] = y[t] + h[t] @ B[idx[t]]`` (in f32, then cast), rows without an adapter
    return ``y[t]`` bit for bit.
    """
    _, _, S, _ = check_expand(h, B, idx, y)
    valid = valid_rows(idx, S)  # [T]
    b_tok = B[jnp.clip(idx, 0, S - 1)]  # [T, R, out]
    d = jnp.einsum("tr,tro->to", h.astype(ACC_DTYPE), b_tok.astype(ACC_DTYPE), precision=_HI)
    out = (y.astype(ACC_DTYPE) + d).astype(y.dtype)  # [T, out]
    return jnp.where(valid[:, None], out, y)


def lora_expand_slices(h, Bs: Sequence, idx, y):  # [T, sum(out_i)]
    """Expand into the column slices of a fused projection (qkv, gate_up).

    Args:
      h:   ``[T, n*R]`` n shrink results side by side (slice i = columns ``i*R:(i+1)*R``).
      Bs:  tuple of n ``[S, R, out_i]`` up matrices.
      idx: ``[T]`` int slot per token.
      y:   ``[T, sum(out_i)]``.

    *Semantics:* ``out[:, off_i:off_i+out_i] = lora_expand(h[:, i*R:(i+1)*R], Bs[i], idx, y[:, off_i:…])``.
    """
    return expand_slices_generic(lora_expand, h, Bs, idx, y)


def add_lora(y, x, A, B, idx):  # [T, out]
    """Shrink then expand for one projection; the rank-R intermediate stays in f32.

    *Semantics:* ``out[t] = y[t] + x[t] @ A[idx[t]] @ B[idx[t]]`` (``y[t]`` when no adapter).
    """
    return lora_expand(lora_shrink(x, A, idx, out_dtype=ACC_DTYPE), B, idx, y)


def add_lora_slices(y, x, A_cat, Bs: Sequence, idx):  # [T, sum(out_i)]
    """Fused-projection LoRA: one shrink with the n A's concatenated on the rank axis.

    Args:
      y: ``[T, sum(out_i)]``; x: ``[T, in]``; A_cat: ``[S, in, n*R]``; Bs: n × ``[S, R, out_i]``.

    *Semantics:* slice i of the output gets ``x @ A_cat[slot][:, i*R:(i+1)*R] @ Bs[i][slot]``.
    """
    return lora_expand_slices(lora_shrink(x, A_cat, idx, out_dtype=ACC_DTYPE), Bs, idx, y)
