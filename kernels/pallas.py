"""The ``pallas`` backend: TPU kernels that only touch the slots a token block actually uses.

Layout (both kernels). Tokens are padded to a multiple of the token block ``bt`` (8 rows for f32,
16 for bf16 — TPU sublane tiling) with ``idx = −1`` and zero activations, so padded rows can never
produce NaN and never contribute. For each token block the wrapper computes, with plain jnp ops,
the sorted list of distinct slots it uses, padded to the static length ``L = min(S, bt)`` by
repeating the last used slot, and how many are real (``counts``). Both are *scalar-prefetched*
into SMEM and drive the weight BlockSpec's index map, so:

* a grid step ``j >= counts[i]`` is skipped with ``pl.when`` and, because its block index equals
  the previous step's, Pallas issues no DMA for it either: slots no token in the block uses cost
  neither bandwidth nor MXU time;
* a block with no adapter at all (every idx −1) computes nothing; its list is ``[0, 0, …]``, so
  at most one weight block (slot 0's, the first step's prefetch) is read for it.

``lora_shrink``, grid ``(token blocks i, in blocks k, active slots j)``: step ``(i, k, j)`` loads
``x[i-block, k-block]`` (fetched once per (i, k)) and ``A[slot_j, k-block, :]``, computes
``x @ A`` (f32 accumulation on the MXU) and adds into an f32 VMEM scratch only the rows whose idx
equals ``slot_j`` (``jnp.where`` on the ``[bt, R]`` product — a select, never a multiply, so
inf/NaN in other tokens' rows cannot leak); the last step writes the ``[bt, R]`` block.

``lora_expand``, grid ``(token blocks i, out blocks n, active slots j)``: step ``(i, n, j)``
accumulates ``where(idx == slot_j, h @ B[slot_j, :, n-block], 0)`` in f32 (the product selected, not
its input: ``0 @ B`` would be NaN for the rows of other slots if ``B[slot_j]`` held a NaN); the last step writes
``y + acc`` (rows without an adapter get ``y`` unchanged). ``y`` is aliased to the output, so
``lora_expand_slices`` runs one call per slice that writes only that slice's column blocks.

Block shapes follow TPU's rule (last two dims divisible by 8×128 or equal to the full dim): the
in/out dims are tiled by a multiple of 128 that divides them (at most 2048) or taken whole, R is
always a whole (full-dim) block. On anything but a TPU the kernels run with ``interpret=True``;
``jax.export`` with ``platforms=["tpu"]`` still runs the Mosaic lowering (see the tests).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from loraserve.kernels.shapes import (
    ACC_DTYPE,
    check_expand,
    check_shrink,
    check_slices,
    expand_slices_generic,
    operand_precision,
    shrink_out_dtype,
    slice_offsets,
    valid_rows,
)

MAX_BLOCK_T = 128  # token rows per block
MAX_BLOCK_LANES = 2048  # in/out columns per block (multiple of 128)


def default_interpret() -> bool:
    """Interpret the kernels (on CPU/GPU) unless we are on a TPU."""
    return jax.default_backend() != "tpu"


def _interp(interpret):
    return default_interpret() if interpret is None else interpret


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def sublanes(dtype) -> int:
    """Rows of one TPU (sublane × lane) tile for ``dtype``: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return {4: 8, 2: 16, 1: 32}.get(jnp.dtype(dtype).itemsize, 8)


def token_block(T: int, dtypes: Sequence, block_t: int | None = None) -> int:
    """Token rows per block: a multiple of every dtype's sublane count, at most ``MAX_BLOCK_T``."""
    sub = max(sublanes(d) for d in dtypes)
    if block_t is None:
        return min(_round_up(T, sub), MAX_BLOCK_T)
    if block_t <= 0 or block_t % sub:
        raise ValueError(f"block_t={block_t} must be a positive multiple of {sub} for {list(dtypes)}")
    return block_t


def lane_block(n: int, cap: int | None = None) -> int:
    """Block size along a lane (last) dim: the largest multiple of 128 ≤ cap dividing n, else n."""
    cap = MAX_BLOCK_LANES if cap is None else cap
    if n % 128:
        return n  # a full-dim block is always legal
    b = max(128, min(cap, n) // 128 * 128)
    while n % b:
        b -= 128
    return b


def active_slots(idx, S: int, bt: int):  # ([nb*L] int32, [nb] int32, L)
    """Per token block, the distinct slots its tokens use.

    Args:
      idx: ``[Tp]`` int32, ``Tp`` a multiple of ``bt``, −1 = no adapter (all values in ``[-1, S)``).

    Returns ``(slots, counts, L)``: ``slots[i*L + j]`` for ``j < counts[i]`` are the used slots of
    block i in increasing order; later entries repeat the last used slot (0 if none) so that the
    pipeline sees an unchanged block index and fetches nothing. ``L = min(S, bt)`` is static.
    Entries are always real slots in ``[0, S)``, never −1 (a −1 block index would wrap silently).

    *Semantics:* ``set(slots[i*L : i*L+counts[i]]) == set(idx[i*bt:(i+1)*bt]) - {-1}``.
    """
    nb = idx.shape[0] // bt
    L = min(S, bt)
    ar = jnp.arange(S, dtype=jnp.int32)
    used = (idx.reshape(nb, bt)[:, :, None] == ar).any(axis=1)  # [nb, S]
    counts = used.sum(axis=1).astype(jnp.int32)  # [nb]
    order = jnp.argsort(jnp.where(used, ar, S + ar), axis=1)[:, :L].astype(jnp.int32)  # used first
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[:, None], axis=1)  # [nb, 1]
    slots = jnp.where(jnp.arange(L)[None, :] < counts[:, None], order, last)  # [nb, L]
    return slots.reshape(-1), counts, L


def _prepare_idx(idx, S: int, Tp: int):  # [Tp] int32
    idx = jnp.where(valid_rows(idx, S), idx, -1).astype(jnp.int32)
    return jnp.pad(idx, (0, Tp - idx.shape[0]), constant_values=-1)


def _pad_rows(a, Tp: int):
    return a if a.shape[0] == Tp else jnp.pad(a, ((0, Tp - a.shape[0]), (0, 0)))


def _operands(a, b):
    """Two dot operands: keep a shared dtype (bf16 × bf16 → f32 on the MXU), else go to f32."""
    if a.dtype == b.dtype:
        return a, b
    return a.astype(ACC_DTYPE), b.astype(ACC_DTYPE)


def _rows_of(idx_ref, value, shape):  # [bt, n] bool
    """Rows whose idx equals ``value``: the int32 ids are broadcast along lanes before comparing."""
    return jnp.broadcast_to(idx_ref[...], shape) == value


def _shrink_kernel(slots_ref, counts_ref, idx_ref, x_ref, a_ref, o_ref, acc_ref):
    i, k, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nk, L = pl.num_programs(1), pl.num_programs(2)

    @pl.when((k == 0) & (j == 0))
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(j < counts_ref[i])
    def _accumulate():
        x, a = _operands(x_ref[...], a_ref[...])  # [bt, bk], [bk, R]
        part = jnp.dot(x, a, precision=operand_precision(x, a), preferred_element_type=ACC_DTYPE)  # [bt, R]
        rows = _rows_of(idx_ref, slots_ref[i * L + j], part.shape)
        acc_ref[...] += jnp.where(rows, part, 0.0)  # select (not multiply): other rows' inf/NaN stay out

    @pl.when((k == nk - 1) & (j == L - 1))
    def _write():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _expand_kernel(slots_ref, counts_ref, idx_ref, h_ref, b_ref, y_ref, o_ref, acc_ref):
    i, j = pl.program_id(0), pl.program_id(2)
    L = pl.num_programs(2)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(j < counts_ref[i])
    def _accumulate():
        h, b = _operands(h_ref[...], b_ref[...])  # [bt, R], [R, bn]
        part = jnp.dot(h, b, precision=operand_precision(h, b), preferred_element_type=ACC_DTYPE)  # [bt, bn]
        rows = _rows_of(idx_ref, slots_ref[i * L + j], part.shape)
        acc_ref[...] += jnp.where(rows, part, 0.0)  # select the product: 0 x NaN of another slot stays out

    @pl.when(j == L - 1)
    def _write():
        y = y_ref[...]  # [bt, bn]
        out = y.astype(ACC_DTYPE) + acc_ref[...]
        has_adapter = jnp.broadcast_to(idx_ref[...], out.shape) >= 0
        o_ref[...] = jnp.where(has_adapter, out, y.astype(ACC_DTYPE)).astype(o_ref.dtype)


def lora_shrink(x, A, idx, *, out_dtype=None, block_t: int | None = None, interpret=None):  # [T, R]
    """Pallas LoRA shrink (see the module docstring for the grid).

    Args:
      x:   ``[T, in]`` activations.
      A:   ``[S, in, R]`` down matrices of every slot.
      idx: ``[T]`` int slot per token; outside ``[0, S)`` (e.g. −1) = no adapter.
      out_dtype: dtype of the result (default: x's dtype); accumulation is f32.
      block_t: token rows per block (default: T rounded up to the sublane tile, at most 128).
      interpret: None = auto (interpret off-TPU), a bool, or a ``pltpu.InterpretParams``.

    *Semantics:* ``h[t] = x[t] @ A[idx[t]]`` if ``idx[t]`` is a slot, else ``0``.
    """
    T, d_in, S, R = check_shrink(x, A, idx)
    out_dtype = shrink_out_dtype(x, out_dtype)
    if T == 0:
        return jnp.zeros((0, R), out_dtype)
    bt = token_block(T, (x.dtype, A.dtype, out_dtype), block_t)
    Tp = _round_up(T, bt)
    idx_p = _prepare_idx(idx, S, Tp)
    slots, counts, L = active_slots(idx_p, S, bt)
    bk = lane_block(d_in)
    grid = (Tp // bt, d_in // bk, L)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=grid,
        in_specs=[
            pl.BlockSpec((bt, 1), lambda i, k, j, s, c: (i, 0)),
            pl.BlockSpec((bt, bk), lambda i, k, j, s, c: (i, k)),
            pl.BlockSpec((pl.Squeezed(), bk, R), lambda i, k, j, s, c: (s[i * L + j], k, 0)),
        ],
        out_specs=pl.BlockSpec((bt, R), lambda i, k, j, s, c: (i, 0)),
        scratch_shapes=[pltpu.VMEM((bt, R), ACC_DTYPE)],
    )
    h = pl.pallas_call(
        _shrink_kernel,
        out_shape=jax.ShapeDtypeStruct((Tp, R), out_dtype),
        grid_spec=spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=2 * Tp * d_in * R,
            transcendentals=0,
            bytes_accessed=x.nbytes
            + Tp * R * jnp.dtype(out_dtype).itemsize
            + min(S, Tp) * d_in * R * A.dtype.itemsize,
        ),
        interpret=_interp(interpret),
        name="lora_shrink",
    )(slots, counts, idx_p[:, None], _pad_rows(x, Tp), A)
    return h[:T]


def _expand_call(h, B, idx_col, slots, counts, L, y, col_block0, bn, bt, interpret):  # [Tp, W]
    """Add ``h @ B[slot]`` into column blocks ``col_block0 …`` (width ``bn``) of y (aliased)."""
    Tp, R = h.shape
    _, _, d_out = B.shape
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(Tp // bt, d_out // bn, L),
        in_specs=[
            pl.BlockSpec((bt, 1), lambda i, n, j, s, c: (i, 0)),
            pl.BlockSpec((bt, R), lambda i, n, j, s, c: (i, 0)),
            pl.BlockSpec((pl.Squeezed(), R, bn), lambda i, n, j, s, c: (s[i * L + j], 0, n)),
            pl.BlockSpec((bt, bn), lambda i, n, j, s, c: (i, col_block0 + n)),
        ],
        out_specs=pl.BlockSpec((bt, bn), lambda i, n, j, s, c: (i, col_block0 + n)),
        scratch_shapes=[pltpu.VMEM((bt, bn), ACC_DTYPE)],
    )
    return pl.pallas_call(
        _expand_kernel,
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid_spec=spec,
        input_output_aliases={5: 0},  # y (after the 2 prefetch args, idx, h, B) is the output
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=2 * Tp * R * d_out,
            transcendentals=0,
            bytes_accessed=h.nbytes
            + 2 * Tp * d_out * y.dtype.itemsize
            + min(B.shape[0], Tp) * R * d_out * B.dtype.itemsize,
        ),
        interpret=_interp(interpret),
        name="lora_expand",
    )(slots, counts, idx_col, h, B, y)


def _common_lane_block(outs: Sequence[int]) -> int | None:
    """One column block width that tiles every slice (so slices can write in place), or None."""
    if len(outs) == 1:
        return lane_block(outs[0])
    g = math.gcd(*outs)
    return lane_block(g) if g % 128 == 0 else None


def lora_expand_slices(h, Bs: Sequence, idx, y, *, block_t: int | None = None, interpret=None):
    """Pallas expand into the column slices of a fused projection (qkv, gate_up).

    Args:
      h:   ``[T, n*R]`` (slice i = columns ``i*R:(i+1)*R``).
      Bs:  n × ``[S, R, out_i]``.
      idx: ``[T]`` int slot per token.
      y:   ``[T, sum(out_i)]``; the result has y's dtype.

    When every ``out_i`` is a multiple of a common 128-multiple block, each slice's kernel writes
    straight into its columns of the (aliased) y; otherwise slices run on column copies and are
    concatenated.

    *Semantics:* ``out[:, off_i:off_i+out_i] = lora_expand(h[:, i*R:(i+1)*R], Bs[i], idx, y[:, off_i:…])``.
    """
    R, outs = check_slices(h, Bs, idx, y)
    bn = _common_lane_block(outs)
    if bn is None:
        return expand_slices_generic(lora_expand, h, Bs, idx, y, block_t=block_t, interpret=interpret)
    T, S = y.shape[0], Bs[0].shape[0]
    if T == 0:
        return y
    bt = token_block(T, (h.dtype, y.dtype, *(b.dtype for b in Bs)), block_t)
    Tp = _round_up(T, bt)
    idx_p = _prepare_idx(idx, S, Tp)
    slots, counts, L = active_slots(idx_p, S, bt)
    h_p, out = _pad_rows(h, Tp), _pad_rows(y, Tp)
    for i, (off, B) in enumerate(zip(slice_offsets(outs), Bs, strict=True)):
        h_i = h_p[:, i * R : (i + 1) * R]
        out = _expand_call(
            h_i, B, idx_p[:, None], slots, counts, L, out, off // bn, bn, bt, _interp(interpret)
        )
    return out[:T]


def lora_expand(h, B, idx, y, *, block_t: int | None = None, interpret=None):  # [T, out]
    """Pallas LoRA expand (see the module docstring for the grid).

    Args:
      h:   ``[T, R]`` shrink results.
      B:   ``[S, R, out]`` up matrices of every slot.
      idx: ``[T]`` int slot per token; outside ``[0, S)`` = no adapter.
      y:   ``[T, out]``; the result has y's dtype.

    *Semantics:* ``out[t] = y[t] + h[t] @ B[idx[t]]`` (f32, then cast); ``y[t]`` exactly when no adapter.
    """
    check_expand(h, B, idx, y)
    return lora_expand_slices(h, (B,), idx, y, block_t=block_t, interpret=interpret)


def add_lora(y, x, A, B, idx, *, block_t: int | None = None, interpret=None):  # [T, out]
    """Shrink + expand for one projection (rank-R intermediate in f32).

    *Semantics:* ``out[t] = y[t] + x[t] @ A[idx[t]] @ B[idx[t]]`` (``y[t]`` when no adapter).
    """
    h = lora_shrink(x, A, idx, out_dtype=ACC_DTYPE, block_t=block_t, interpret=interpret)
    return lora_expand(h, B, idx, y, block_t=block_t, interpret=interpret)


def add_lora_slices(y, x, A_cat, Bs: Sequence, idx, *, block_t: int | None = None, interpret=None):
    """Fused-projection LoRA: A_cat ``[S, in, n*R]``, Bs n × ``[S, R, out_i]``, y ``[T, sum(out_i)]``.

    *Semantics:* slice i of the output gets ``x @ A_cat[slot][:, i*R:(i+1)*R] @ Bs[i][slot]``.
    """
    h = lora_shrink(x, A_cat, idx, out_dtype=ACC_DTYPE, block_t=block_t, interpret=interpret)
    return lora_expand_slices(h, Bs, idx, y, block_t=block_t, interpret=interpret)
