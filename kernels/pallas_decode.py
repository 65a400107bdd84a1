"""The ``pallas`` backend's decode: one kernel call per projection that reads each slot in use exactly once.

A decode batch is a few dozen to a few hundred rows, often each on its own adapter; the step is bound by
the bytes it reads, and what an adapter adds is its matrices: per slot ``A [in, n*R]`` and the n ``B_i [R,
out_i]``, e.g. 1.2 MB for Llama-3-8B's gate/up at rank 16. The tiled kernels of :mod:`kernels.pallas` walk a
``(token block, column block, slot)`` grid with 2048-column blocks: at batch 64 on a TPU v5e that is ~600 grid
steps of 64 KB reads per projection, which cost more than the bytes (the backend measured slower than XLA's).

Here one kernel call (no grid) does a projection's shrink and expand for the whole batch:

* **the plan** (host, numpy, per step: :func:`plan_decode`) lists the distinct slots in use (segments, in
  increasing slot order) and, for each, the windows of :data:`WIN` rows that hold its rows; the arrays are
  padded to sizes fixed by the batch and slot count, so a new adapter mix never recompiles;
* **the weights** of segment ``j + 1`` are copied HBM → VMEM (``make_async_copy``: A whole, each ``B_i`` into
  its block of a block-diagonal ``[n*R, sum(out_i)]`` buffer whose other blocks stay zero) while segment ``j``
  computes, two buffers alternating: a slot's bytes are read once, in a few large DMAs, and the loop runs for
  the segments there are (a dynamic trip count: slots no row uses cost nothing, not even a grid step);
* **the rows**: for each window of segment j, ``h = x_w @ A_j`` (``[WIN, n*R]``, f32 accumulation over
  :data:`K_CHUNK`-input chunks), then ``h @ Bcat_j`` (h in the B pool's dtype, as xla-grouped does) gives every
  slice's columns at once, :data:`CHUNK` columns at a time, and only the window's rows on slot j take ``y +
  that`` (a select, not a multiply: an inf/NaN in another row's input or in another slot's matrices never
  reaches a row). Each row is in exactly one (segment, window) pair, so it is written once: ``out = (y_f32 +
  h @ B).astype(y.dtype)``.

``x``, ``y`` and the output live in VMEM whole (a decode batch's activations: 64 rows × 28672 bf16 columns is
3.7 MB), ``y`` copied into the output by one VMEM-local DMA; :func:`fits` says when they do not fit and the
backend uses the tiled kernels instead, as it does when a slice's width is not a multiple of 128 lanes or, for
fused slices, the rank not a multiple of the B pool's sublane tile (the block-diagonal buffer's DMAs write at
those offsets). Off a TPU the kernel runs interpreted (``interpret=True``: DMAs and semaphores simulated, ~2 ms
a call at 64 rows where ``pltpu.InterpretParams``' more faithful mode takes 250 ms).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from loraserve.kernels import pallas as tiled
from loraserve.kernels.pallas import _pad_rows, _round_up, sublanes
from loraserve.kernels.shapes import ACC_DTYPE, operand_precision, slice_offsets

WIN = 16  # rows per window: a multiple of the sublane tile of every dtype used (8 rows f32, 16 bf16)
LANES = 128
CHUNK = 1024  # output columns per expand product and select inside a window (a multiple of LANES)
# input features per shrink product inside a window (a multiple of LANES; f32 sums between them)
K_CHUNK = 2048


def vmem_capacity() -> int:
    """VMEM of one TensorCore of this process's TPU (128 MiB on a v5e or v6e, 64 MiB on a v5p, 16 MiB on a v4);
    128 MiB off a TPU (interpreted, and for lowering on a CPU)."""
    if jax.default_backend() == "tpu":
        with contextlib.suppress(Exception):  # a chip JAX does not describe: assume the smallest
            return int(pltpu.get_tpu_info().vmem_capacity_bytes)
        return 16 << 20
    return 128 << 20


def vmem_budget() -> int:
    """What the kernel may keep in VMEM (x, y, the output and two weight buffers): three quarters of the
    core's (XLA keeps some); above it the tiled kernels run."""
    return vmem_capacity() * 3 // 4


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class DecodePlan:
    """Which slots a decode batch uses and where their rows are, for :func:`add_lora_slices_decode`.

    ``idx [B]`` the slot of every row (−1 none); ``seg_slot [Smax]`` the distinct slots in use, increasing,
    then padding; ``seg_lo, seg_hi [Smax]`` segment j's windows are ``wins[seg_lo[j]:seg_hi[j]]``; ``wins
    [Wmax]`` row-window numbers (rows ``w*WIN … w*WIN+WIN-1``); ``count [1]`` the number of segments.
    Sizes depend on B and the slot count only: ``Smax = min(S, B)``, ``Wmax = min(B, S × windows)``.
    """

    idx: jax.Array
    seg_slot: jax.Array
    seg_lo: jax.Array
    seg_hi: jax.Array
    wins: jax.Array
    count: jax.Array

    def tree_flatten(self):
        return (self.idx, self.seg_slot, self.seg_lo, self.seg_hi, self.wins, self.count), None

    @classmethod
    def tree_unflatten(cls, _aux, children):
        return cls(*children)


def plan_decode(slots, num_slots: int) -> DecodePlan:
    """The plan of a batch whose row b is on slot ``slots[b]`` (anything outside ``[0, num_slots)`` = none).

    Host-side numpy (~20 µs at 256 rows). *Semantics:* for every slot s used by some row, exactly one
    segment has ``seg_slot == s``, and its windows are exactly the windows holding a row on s.
    """
    slots = np.asarray(slots).astype(np.int64)
    rows = slots.shape[0]
    valid = (slots >= 0) & (slots < num_slots)
    idx = np.where(valid, slots, -1).astype(np.int32)
    windows = _round_up(max(rows, 1), WIN) // WIN
    smax = max(1, min(num_slots, rows))
    wmax = max(1, min(rows, num_slots * windows))
    keys = np.unique(slots[valid] * windows + np.nonzero(valid)[0] // WIN)  # (slot, window), sorted
    pair_slot, pair_win = keys // windows, keys % windows
    distinct, first, per = np.unique(pair_slot, return_index=True, return_counts=True)
    n = distinct.shape[0]
    seg_slot = np.full(smax, distinct[-1] if n else 0, np.int32)
    seg_slot[:n] = distinct
    seg_lo = np.zeros(smax, np.int32)
    seg_hi = np.zeros(smax, np.int32)
    seg_lo[:n], seg_hi[:n] = first, first + per
    wins = np.zeros(wmax, np.int32)
    wins[: pair_win.shape[0]] = pair_win
    return DecodePlan(idx, seg_slot, seg_lo, seg_hi, wins, np.array([n], np.int32))


def fits(
    rows: int, d_in: int, rank_cols: int, outs: Sequence[int], x_dtype, a_dtype, b_dtype, y_dtype
) -> bool:
    """Whether :func:`add_lora_slices_decode` takes this shape: every slice width (hence offset) a multiple of
    128 lanes, and its VMEM (:func:`vmem_bytes`) within :func:`vmem_budget`."""
    if any(o % LANES for o in outs):
        return False
    if len(outs) > 1 and (rank_cols // len(outs)) % sublanes(b_dtype):
        return False
    return vmem_bytes(rows, d_in, rank_cols, outs, x_dtype, a_dtype, b_dtype, y_dtype) <= vmem_budget()


def vmem_bytes(
    rows: int, d_in: int, rank_cols: int, outs: Sequence[int], x_dtype, a_dtype, b_dtype, y_dtype
) -> int:
    """What the kernel keeps in VMEM: x, y and the output whole, two A and two block-diagonal B buffers, the
    row slots (one 32-bit lane tile per 8 rows) and a window's f32 temporaries."""
    tp, width = _round_up(rows, WIN), sum(outs)
    item = lambda d: jnp.dtype(d).itemsize  # noqa: E731
    lanes = lambda n: _round_up(n, LANES)  # noqa: E731  (a VMEM array's minor dim is padded to 128 lanes)
    return (
        tp * lanes(d_in) * item(x_dtype)
        + 2 * tp * width * item(y_dtype)
        + tp * LANES * 4
        + 2 * d_in * lanes(rank_cols) * item(a_dtype)
        + 2 * _round_up(rank_cols, 16) * width * item(b_dtype)
        + 4 * WIN * (CHUNK + lanes(d_in)) * 4
    )


def _kernel(outs, rank, seg_slot, seg_lo, seg_hi, wins, count, idx_ref, x_ref, a_hbm, *rest):
    n, width = len(outs), sum(outs)
    b_hbm, (y_ref, o_ref, a_buf, b_buf, sem) = rest[:n], rest[n:]
    offsets = slice_offsets(outs)

    b_buf[...] = jnp.zeros_like(b_buf)  # the blocks off the diagonal stay zero; the DMAs fill the diagonal
    out_copy = pltpu.make_async_copy(y_ref, o_ref, sem.at[0, 0])  # y into the output: one VMEM-local DMA
    out_copy.start()
    out_copy.wait()
    d_in = x_ref.shape[1]
    k_chunk = K_CHUNK if d_in % LANES == 0 else d_in  # x's lanes sliced at multiples of 128 only

    def copies(j, buf):  # segment j's matrices into buffer ``buf``
        slot = seg_slot[j]
        out = [pltpu.make_async_copy(a_hbm.at[slot], a_buf.at[buf], sem.at[buf, 0])]
        for i, (off, out_i) in enumerate(zip(offsets, outs, strict=True)):
            dst = b_buf.at[buf, pl.ds(i * rank, rank), pl.ds(off, out_i)]
            out.append(pltpu.make_async_copy(b_hbm[i].at[slot], dst, sem.at[buf, 1 + i]))
        return out

    @pl.when(count[0] > 0)
    def _first():
        for c in copies(0, 0):
            c.start()

    def segment(j, carry):
        buf = j % 2

        @pl.when(j + 1 < count[0])
        def _next():
            for c in copies(j + 1, 1 - buf):
                c.start()

        for c in copies(j, buf):
            c.wait()
        slot = seg_slot[j]

        def window(w, carry):
            r0 = pl.multiple_of(wins[w] * WIN, WIN)
            rows = pl.ds(r0, WIN)
            h = None
            # input chunks: each product's operands stay a few hundred vregs
            for k0 in range(0, d_in, k_chunk):
                ks = slice(k0, min(k0 + k_chunk, d_in))
                xw, a = x_ref[rows, ks], a_buf[buf, ks, :]
                if xw.dtype != a.dtype:
                    xw, a = xw.astype(ACC_DTYPE), a.astype(ACC_DTYPE)
                part = jnp.dot(xw, a, precision=operand_precision(xw, a), preferred_element_type=ACC_DTYPE)
                h = part if h is None else h + part
            h = h.astype(b_buf.dtype)  # as xla-grouped: h in the B pool's dtype, one MXU pass for bf16 pools
            row_slot = idx_ref[rows, :]  # [WIN, 1] int32
            for c0 in range(0, width, CHUNK):  # column chunks: a window's f32 values stay a few dozen vregs
                cols = slice(c0, min(c0 + CHUNK, width))
                b = b_buf[buf, :, cols]
                part = jnp.dot(h, b, precision=operand_precision(h, b), preferred_element_type=ACC_DTYPE)
                yw = o_ref[rows, cols].astype(ACC_DTYPE)
                # the ids broadcast, then compared (as kernels.pallas does)
                mine = jnp.broadcast_to(row_slot, yw.shape) == slot
                o_ref[rows, cols] = jnp.where(mine, yw + part, yw).astype(o_ref.dtype)
            return carry

        return jax.lax.fori_loop(seg_lo[j], seg_hi[j], window, carry)

    jax.lax.fori_loop(0, count[0], segment, 0)


def add_lora_slices_decode(y, x, A, Bs: Sequence, plan: DecodePlan, *, interpret=None):  # [B, sum(out_i)]
    """One decode step's LoRA for a (fused) projection: ``A [S, in, n*R]``, ``Bs`` n × ``[S, R, out_i]``,
    ``y [B, sum(out_i)]``, ``x [B, in]``, ``plan`` from :func:`plan_decode` over the same B and S.

    *Semantics:* slice i of row b gets ``x[b] @ A[s][:, i*R:(i+1)*R] @ Bs[i][s]`` added (f32, then y's dtype),
    s = ``plan.idx[b]``; rows without a slot return ``y[b]`` exactly. ``interpret``: None = off a TPU.
    """
    rows, width = y.shape
    S, d_in, rank_cols = A.shape
    rank = Bs[0].shape[1]
    outs = tuple(int(b.shape[2]) for b in Bs)
    tp = _round_up(rows, WIN)
    idx = jnp.pad(plan.idx, (0, tp - rows), constant_values=-1)[:, None]
    if interpret is None:
        interpret = tiled.default_interpret()  # off a TPU (one switch for both kernel modules)
    smem, vmem, hbm = (pl.BlockSpec(memory_space=m) for m in (pltpu.SMEM, pltpu.VMEM, pl.ANY))
    need = vmem_bytes(rows, d_in, rank_cols, outs, x.dtype, A.dtype, Bs[0].dtype, y.dtype)
    adapters = min(S, rows) * (A[0].nbytes + sum(b[0].nbytes for b in Bs))
    out = pl.pallas_call(
        lambda *refs: _kernel(outs, rank, *refs),
        out_shape=jax.ShapeDtypeStruct((tp, width), y.dtype),
        in_specs=[smem] * 5 + [vmem, vmem, hbm, *([hbm] * len(Bs)), vmem],
        out_specs=vmem,
        scratch_shapes=[
            pltpu.VMEM((2, d_in, rank_cols), A.dtype),
            pltpu.VMEM((2, rank_cols, width), Bs[0].dtype),
            pltpu.SemaphoreType.DMA((2, 1 + len(Bs))),
        ],
        input_output_aliases={6 + 1 + 1 + len(Bs): 0},  # y is the output's buffer
        compiler_params=pltpu.CompilerParams(
            vmem_limit_bytes=min(need * 5 // 4 + (8 << 20), vmem_capacity() * 7 // 8)
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * tp * (d_in * rank_cols + rank_cols * width),
            transcendentals=0,
            bytes_accessed=x.nbytes + 2 * y.nbytes + adapters,
        ),
        interpret=interpret,
        name="lora_decode",
    )(
        plan.seg_slot,
        plan.seg_lo,
        plan.seg_hi,
        plan.wins,
        plan.count,
        idx,
        _pad_rows(x, tp),
        A,
        *Bs,
        _pad_rows(y, tp),
    )
    return out[:rows]
