"""The ``pallas`` backend's decode: one kernel call per projection, each slot in use read once, the MXU fed
128 rank rows at a time.

A decode batch is a few dozen to a few hundred rows, often each on its own adapter; the step is bound by
the bytes it reads, and what an adapter adds is its matrices: per slot ``A`` (n*R × in) and the n ``B_i``
(R × out_i), e.g. 1.2 MB for Llama-3-8B's gate/up at rank 16. Two things decide the speed on a TPU:

* **the pools' layout**: a TPU stores an array in (sublane × 128-lane) tiles of its two minor dimensions,
  so a rank-16 matrix with the rank as its minor (lane) dimension occupies 8× its bytes in HBM and every
  read of it moves them all. This backend's pools put the rank on the sublanes of both matrices:
  ``A [S, n*R, in]`` and ``B_i [S, R, out_i]`` (the rank is a multiple of the sublane tile, 8 rows in f32
  and 16 in bf16, so nothing is padded);
* **the MXU's weight tiles**: a product ``h @ B`` loads B into the 128 × 128 systolic array tile by tile,
  and a tile costs the same whether 16 or 128 of its rows are used. One product per adapter (the first
  version of this kernel, and the tiled kernels of :mod:`kernels.pallas`) loads ``out/128`` tiles per rank-16
  adapter with 16 live rows each; the chip measured it slower than XLA.

Here the slots are taken in **groups** of ``G = 128 // R`` consecutive slot numbers (8 at rank 16), so that
the G adapters' rank rows fill one 128-deep MXU tile. One kernel call (no grid) does a projection for the
whole batch:

* **the plan** (host, numpy, per step: :func:`plan_decode`) is every row's slot and a flag per slot in use;
  inside the jitted step the groups holding a slot in use are listed in increasing order (padded to a size
  fixed by the slot count: a new adapter mix never recompiles);
* **the weights** of group ``j + 1`` are copied HBM → VMEM (``make_async_copy``, one DMA per matrix of a slot
  in use, each into its rows of the group's ``[G*R, in]`` A buffer per slice and ``[G*R, sum(out_i)]`` B
  buffer) while group ``j`` computes, two buffers alternating; the rows of slots no row uses are zeroed in
  VMEM instead of read. Groups without a slot in use cost nothing (the loop runs for the groups there are);
* **the rows**: per slice i, ``h = x @ A_g,i^T`` for every row at once (``[rows, G*R]``, f32 accumulation over
  :data:`K_CHUNK`-input chunks), then each row keeps only the G*R columns of its own slot (a select: an
  inf/NaN in another slot's A, or in another row's x, never reaches it), and ``h @ B_g,i`` (h in the B pool's
  dtype, as xla-grouped does) gives the slice's columns, :data:`COLS` at a time; the rows of the group's
  slots take ``y + that`` (a select), the others keep their value. Each row is written in exactly one group,
  so ``out = (y_f32 + h @ B).astype(y.dtype)`` whatever else is in the batch (batch invariance).

Row isolation needs one more thing: the rows outside a slot meet its ``B`` as exact zeros, and ``0 × inf`` is
NaN. The backend's pools therefore hold finite B values only: :meth:`PallasBackend.to_pool_layout` zeroes a
non-finite entry as the slot is written (the ``xla-onehot`` backend zeroes them as it reads; the slot's own rows
lose the NaN either way, no other row ever sees it).

``x``, ``y`` and the output live in VMEM whole (a decode batch's activations: 64 rows × 28672 bf16 columns is
3.7 MB), ``y`` copied into the output by one VMEM-local DMA; :func:`fits` says when they do not fit, or a slice's
width is not a multiple of 128 lanes, or the rank not a multiple of the pools' sublane tile (the DMAs write at
multiples of it): the backend then runs the ``xla-onehot`` product on the same pools. Off a TPU the kernel runs
interpreted (``interpret=True``: DMAs and semaphores simulated).
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

LANES = 128
# rank rows per group: the depth of a v5e's MXU (one weight tile of a group's B); a deeper group (256, 512)
# rewrites the output once per more slots, at the price of whole-group products where few of its slots are used
MXU_DEPTH = 128
ROW_TILE = 16  # rows are padded to a multiple of this (the sublane tile of every dtype used: 8 f32, 16 bf16)
ROW_CHUNK = 128  # rows per product
COLS = 512  # output columns per expand product and select (a multiple of LANES)
K_CHUNK = 512  # input features per shrink product (a multiple of LANES; f32 sums between them)
_NT = (((1,), (1,)), ((), ()))  # [M, K] x [N, K] -> [M, N]: both operands with the inputs on their lanes


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
    core's (XLA keeps some); above it the backend runs the XLA product."""
    return vmem_capacity() * 3 // 4


def group_size(rank: int, depth: int | None = None) -> int:
    """Slots per group: as many rank-``rank`` blocks as fill ``depth`` rows (default :data:`MXU_DEPTH`; at
    least one slot)."""
    return max(1, (depth or MXU_DEPTH) // rank)


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class DecodePlan:
    """Which slot each row of a decode batch is on, for :func:`add_lora_slices_decode`.

    ``idx [B]`` int32, the slot of every row (−1 none); ``used [S]`` int32, 1 where some row is on the slot.
    Sizes depend on B and the slot count only.
    """

    idx: jax.Array
    used: jax.Array

    def tree_flatten(self):
        return (self.idx, self.used), None

    @classmethod
    def tree_unflatten(cls, _aux, children):
        return cls(*children)


def plan_decode(slots, num_slots: int) -> DecodePlan:
    """The plan of a batch whose row b is on slot ``slots[b]`` (anything outside ``[0, num_slots)`` = none).

    Host-side numpy (a few µs). *Semantics:* ``used[s] == 1`` exactly when some row has ``idx == s``.
    """
    slots = np.asarray(slots).astype(np.int64)
    valid = (slots >= 0) & (slots < num_slots)
    idx = np.where(valid, slots, -1).astype(np.int32)
    used = np.zeros(max(1, num_slots), np.int32)
    used[idx[valid]] = 1
    return DecodePlan(idx, used)


def groups_in_use(used, group: int):  # ([ng] int32, [1] int32, [ng * group] int32)
    """Traced: the groups of ``group`` consecutive slots holding a slot in use, increasing, then the last
    of them repeated; their count; and ``used`` padded to whole groups."""
    S = used.shape[0]
    ng = -(-S // group)
    flags = jnp.pad(used.astype(jnp.int32), (0, ng * group - S))
    live = flags.reshape(ng, group).max(axis=1) > 0
    count = live.sum().astype(jnp.int32)
    order = jnp.argsort(jnp.where(live, 0, 1), stable=True).astype(jnp.int32)  # live groups first, in order
    last = order[jnp.maximum(count - 1, 0)]
    groups = jnp.where(jnp.arange(ng) < count, order, last)
    return groups, count.reshape(1), flags


def fits(
    rows: int,
    d_in: int,
    rank_cols: int,
    outs: Sequence[int],
    x_dtype,
    a_dtype,
    b_dtype,
    y_dtype,
    depth: int | None = None,
) -> bool:
    """Whether :func:`add_lora_slices_decode` takes this shape: every slice width (hence offset) a multiple of
    128 lanes, the rank a multiple of both pools' sublane tile, and its VMEM (:func:`vmem_bytes`) within
    :func:`vmem_budget`."""
    rank = rank_cols // max(1, len(outs))
    if any(o % LANES for o in outs) or rank % sublanes(a_dtype) or rank % sublanes(b_dtype):
        return False
    need = vmem_bytes(rows, d_in, rank_cols, outs, x_dtype, a_dtype, b_dtype, y_dtype, depth)
    return need <= vmem_budget()


def vmem_bytes(
    rows: int,
    d_in: int,
    rank_cols: int,
    outs: Sequence[int],
    x_dtype,
    a_dtype,
    b_dtype,
    y_dtype,
    depth: int | None = None,
) -> int:
    """What the kernel keeps in VMEM: x, y and the output whole, two A and two B group buffers, the row slots
    (one 32-bit lane tile per 8 rows) and a row chunk's f32 temporaries."""
    tp, width, n = padded_rows(rows), sum(outs), max(1, len(outs))
    depth = group_size(rank_cols // n, depth) * (rank_cols // n)
    item = lambda d: jnp.dtype(d).itemsize  # noqa: E731
    lanes = lambda k: _round_up(k, LANES)  # noqa: E731  (a VMEM array's minor dim is padded to 128 lanes)
    chunk = min(tp, ROW_CHUNK)
    return (
        tp * lanes(d_in) * item(x_dtype)
        + 2 * tp * width * item(y_dtype)
        + tp * LANES * 4
        + 2 * n * depth * lanes(d_in) * item(a_dtype)
        + 2 * depth * width * item(b_dtype)
        + 4 * chunk * (2 * COLS + lanes(depth) + K_CHUNK) * 4
    )


def padded_rows(rows: int) -> int:
    """The rows the kernel computes: a multiple of :data:`ROW_TILE`, and of :data:`ROW_CHUNK` above it."""
    tp = _round_up(max(rows, 1), ROW_TILE)
    return tp if tp <= ROW_CHUNK else _round_up(tp, ROW_CHUNK)


def _kernel(outs, rank, group, groups, count, used, idx_ref, x_ref, a_hbm, *rest):
    n, width = len(outs), sum(outs)
    b_hbm, (y_ref, o_ref, a_buf, b_buf, sem) = rest[:n], rest[n:]
    offsets = slice_offsets(outs)
    depth = group * rank
    tp, d_in = x_ref.shape
    chunk = min(tp, ROW_CHUNK)
    k_chunk = K_CHUNK if d_in % LANES == 0 else d_in  # x's lanes sliced at multiples of 128 only

    out_copy = pltpu.make_async_copy(y_ref, o_ref, sem.at[0, 0])  # y into the output: one VMEM-local DMA
    out_copy.start()
    out_copy.wait()

    def copies(j, buf):  # (slot in use?, copy) for every matrix of group j's slots, into buffer ``buf``
        out = []
        for p in range(group):
            slot = groups[j] * group + p
            rows = pl.ds(p * rank, rank)
            for i, (off, out_i) in enumerate(zip(offsets, outs, strict=True)):
                src = a_hbm.at[slot, pl.ds(i * rank, rank)]
                out.append((slot, pltpu.make_async_copy(src, a_buf.at[buf, i, rows], sem.at[buf, 0])))
                dst = b_buf.at[buf, rows, pl.ds(off, out_i)]
                out.append((slot, pltpu.make_async_copy(b_hbm[i].at[slot], dst, sem.at[buf, 1])))
        return out

    def each(j, buf, method):
        for slot, c in copies(j, buf):
            pl.when(used[slot] > 0)(getattr(c, method))

    @pl.when(count[0] > 0)
    def _first():
        each(0, 0, "start")

    def one_group(j, carry):
        buf = jax.lax.rem(j, 2)

        @pl.when(j + 1 < count[0])
        def _next():
            each(j + 1, 1 - buf, "start")

        each(j, buf, "wait")
        g = groups[j]
        for p in range(group):  # a slot no row uses: its B rows zeroed (they meet h's zeros: no stale NaN)

            @pl.when(used[g * group + p] == 0)
            def _zero(p=p):
                for c0 in range(0, width, COLS):
                    cols = pl.ds(c0, min(COLS, width - c0))
                    b_buf[buf, pl.ds(p * rank, rank), cols] = jnp.zeros((rank, cols.size), b_buf.dtype)

        first = g * group
        col_slot = first + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (1, depth), 1), jnp.int32(rank))
        for r0 in range(0, tp, chunk):
            rows = pl.ds(r0, chunk)
            row_slot = idx_ref[rows, :]  # [chunk, 1] int32
            mine = jnp.broadcast_to(row_slot, (chunk, depth)) == jnp.broadcast_to(col_slot, (chunk, depth))
            in_group = (row_slot >= first) & (row_slot < first + group)  # [chunk, 1]
            for i, (off, out_i) in enumerate(zip(offsets, outs, strict=True)):
                h = None
                for k0 in range(0, d_in, k_chunk):
                    ks = pl.ds(k0, min(k_chunk, d_in - k0))
                    xw, a = x_ref[rows, ks], a_buf[buf, i, :, ks]
                    if xw.dtype != a.dtype:
                        xw, a = xw.astype(ACC_DTYPE), a.astype(ACC_DTYPE)
                    part = jax.lax.dot_general(
                        xw, a, _NT, precision=operand_precision(xw, a), preferred_element_type=ACC_DTYPE
                    )
                    h = part if h is None else h + part
                h = jnp.where(mine, h, 0.0).astype(b_buf.dtype)  # each row: its own slot's columns only
                for c0 in range(off, off + out_i, COLS):
                    cols = pl.ds(c0, min(COLS, off + out_i - c0))
                    b = b_buf[buf, :, cols]
                    part = jnp.dot(h, b, precision=operand_precision(h, b), preferred_element_type=ACC_DTYPE)
                    yw = o_ref[rows, cols].astype(ACC_DTYPE)
                    take = jnp.broadcast_to(in_group, yw.shape)
                    o_ref[rows, cols] = jnp.where(take, yw + part, yw).astype(o_ref.dtype)
        return carry

    jax.lax.fori_loop(0, count[0], one_group, 0)


def add_lora_slices_decode(
    y, x, A, Bs: Sequence, plan: DecodePlan, *, interpret=None, depth: int | None = None
):  # [B, sum(out_i)]
    """One decode step's LoRA for a (fused) projection: ``A [S, n*R, in]``, ``Bs`` n × ``[S, R, out_i]`` (finite
    values: see the module docstring), ``y [B, sum(out_i)]``, ``x [B, in]``, ``plan`` from :func:`plan_decode`
    over the same B and S.

    *Semantics:* slice i of row b gets ``x[b] @ A[s][i*R:(i+1)*R].T @ Bs[i][s]`` added (f32, then y's dtype),
    s = ``plan.idx[b]``; rows without a slot return ``y[b]`` exactly. ``interpret``: None = off a TPU;
    ``depth``: a group's rank rows (:func:`group_size`; the values do not depend on it).
    """
    rows, width = y.shape
    S, rank_cols, d_in = A.shape
    rank = Bs[0].shape[1]
    outs = tuple(int(b.shape[2]) for b in Bs)
    group = group_size(rank, depth)
    tp = padded_rows(rows)
    idx = jnp.pad(plan.idx, (0, tp - rows), constant_values=-1)[:, None]
    groups, count, used = groups_in_use(plan.used, group)
    if interpret is None:
        interpret = tiled.default_interpret()  # off a TPU (one switch for both kernel modules)
    smem, vmem, hbm = (pl.BlockSpec(memory_space=m) for m in (pltpu.SMEM, pltpu.VMEM, pl.ANY))
    need = vmem_bytes(rows, d_in, rank_cols, outs, x.dtype, A.dtype, Bs[0].dtype, y.dtype, depth)
    adapters = min(S, rows) * (A[0].nbytes + sum(b[0].nbytes for b in Bs))
    depth = group * rank
    out = pl.pallas_call(
        lambda *refs: _kernel(outs, rank, group, *refs),
        out_shape=jax.ShapeDtypeStruct((tp, width), y.dtype),
        in_specs=[smem] * 3 + [vmem, vmem, hbm, *([hbm] * len(Bs)), vmem],
        out_specs=vmem,
        scratch_shapes=[
            pltpu.VMEM((2, len(Bs), depth, d_in), A.dtype),
            pltpu.VMEM((2, depth, width), Bs[0].dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
        ],
        input_output_aliases={3 + 1 + 1 + 1 + len(Bs): 0},  # y is the output's buffer
        compiler_params=pltpu.CompilerParams(
            vmem_limit_bytes=min(need * 5 // 4 + (8 << 20), vmem_capacity() * 7 // 8)
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * tp * (d_in * rank_cols + rank_cols * width) * min(S, rows),
            transcendentals=0,
            bytes_accessed=x.nbytes + 2 * y.nbytes + adapters,
        ),
        interpret=interpret,
        name="lora_decode",
    )(groups, count, used, idx, _pad_rows(x, tp), A, *Bs, _pad_rows(y, tp))
    return out[:rows]
