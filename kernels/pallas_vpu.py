"""A decode LoRA kernel on the TPU's vector unit: each row's adapter applied by multiply-adds, no MXU (an
experiment of #56, timed by ``bench/kernels.py --scan`` as ``pallas-vpu``; no engine uses it yet).

Why: in a decode step with distinct adapters each adapter's matrices meet one row. The MXU is a systolic array
whose weights are loaded a 128 × 128 tile at a time; a tile used by a handful of rows costs its load whatever
the rows, so on the chip both the MXU kernel of :mod:`kernels.pallas_decode` and XLA's grouped product took
~0.2 ms a layer for 128 rank-16 adapters at 4096 → 14336 (75 MB of adapters: 0.09 ms of HBM at 819 GB/s). Here
each row is ``h = A x`` (R sums of products over the input) and ``y += Σ_k h_k B_k``: R·(in + out) multiply-adds
a row on the VPU, whose work then hides under the adapters' DMA.

Layouts (everything with a minor dimension of 128 lanes, so that a row and a rank row are whole tiles):

* pools, per slot: ``A [n·R, in/128, 128]`` and ``B_i [R, out_i/128, 128]`` (:func:`to_pool`, a reshape of the
  rank-major ``[n·R, in]`` and ``[R, out_i]``);
* activations: ``x [B, in/128, 128]``, ``y [B, W/128, 128]`` (W = Σ out_i): a row is ``x[r]``, indexed on the
  leading dimension (XLA reshapes ``[B, in]`` to it with a copy of the activations, a few MB).

The plan (:func:`plan_vpu`, host numpy) sorts the rows by slot: for each slot in use (``uslot``) its rows'
positions ``order[ustart[u]:ustart[u+1]]``. One kernel call, no grid: slot ``u + 1``'s matrices are copied HBM →
VMEM (one DMA per matrix) while slot ``u``'s rows compute, two buffers alternating, so each slot in use is read
once. A row's result depends on its own x and slot only (f32 sums in a fixed order; ``h`` rounded to the B
pool's dtype as :mod:`kernels.xla` does), rows without a slot keep ``y``'s bits, and a slot's non-finite values
reach its own rows only (no product ever meets another slot's values).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from loraserve.kernels import pallas as tiled
from loraserve.kernels.pallas import sublanes
from loraserve.kernels.pallas_decode import vmem_capacity
from loraserve.kernels.shapes import ACC_DTYPE, slice_offsets

LANES = 128
CHUNK = 32  # the output's 128-lane rows per expand step (a [R, 32, 128] f32 temporary: 256 KB at R = 16)


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class VpuPlan:
    """``order [B]`` the rows with a slot, sorted by slot (then row), padded; ``uslot [B]`` the slots in use in
    that order, padded; ``ustart [B + 1]`` where each slot's rows start in ``order`` (``ustart[nu]`` = the rows
    with a slot); ``nu [1]`` the slots in use. Sizes depend on B only."""

    order: jax.Array
    uslot: jax.Array
    ustart: jax.Array
    nu: jax.Array

    def tree_flatten(self):
        return (self.order, self.uslot, self.ustart, self.nu), None

    @classmethod
    def tree_unflatten(cls, _aux, children):
        return cls(*children)


def plan_vpu(slots, num_slots: int) -> VpuPlan:
    """The plan of a batch whose row b is on slot ``slots[b]`` (outside ``[0, num_slots)``: none). Host numpy."""
    slots = np.asarray(slots).astype(np.int64)
    rows = slots.shape[0]
    valid = (slots >= 0) & (slots < num_slots)
    key = np.where(valid, slots, num_slots)
    order = np.argsort(key, kind="stable")
    order = order[: int(valid.sum())]
    sorted_slots = slots[order]
    new = np.ones(len(order), bool)
    new[1:] = sorted_slots[1:] != sorted_slots[:-1]
    starts = np.flatnonzero(new)
    nu = len(starts)
    out_order = np.zeros(rows, np.int32)
    out_order[: len(order)] = order
    uslot = np.zeros(max(rows, 1), np.int32)
    uslot[:nu] = sorted_slots[starts]
    ustart = np.full(rows + 1, len(order), np.int32)
    ustart[:nu] = starts
    return VpuPlan(out_order, uslot, ustart, np.array([nu], np.int32))


def to_pool(value):
    """A slot's rank-major matrix ``[rows, features]`` as this kernel's pool entry ``[rows, features/128, 128]``."""
    return value.reshape(value.shape[0], value.shape[1] // LANES, LANES)


def from_pool(value):
    return value.reshape(value.shape[0], value.shape[1] * LANES)


def vmem_bytes(rows: int, d_in: int, rank: int, outs: Sequence[int], x_dtype, pool_dtype, y_dtype) -> int:
    """x, y and the output whole, two buffers of one slot's matrices, and the f32 temporaries."""
    item = lambda d: jnp.dtype(d).itemsize  # noqa: E731
    width, n = sum(outs), len(outs)
    return (
        rows * d_in * item(x_dtype)
        + 2 * rows * width * item(y_dtype)
        + 2 * (n * rank * d_in + rank * width) * item(pool_dtype)
        + 4 * rank * (d_in + CHUNK * LANES) * 4
    )


def fits(rows: int, d_in: int, rank: int, outs: Sequence[int], x_dtype, pool_dtype, y_dtype) -> bool:
    """Whether the kernel takes this shape: every width a multiple of 128 lanes, each slice's 128-lane rows
    starting on the output's sublane tile, and its VMEM within three quarters of the core's."""
    if d_in % LANES or any(o % LANES for o in outs):
        return False
    tile = sublanes(y_dtype)
    if any((off // LANES) % tile for off in slice_offsets(outs)):
        return False
    return vmem_bytes(rows, d_in, rank, outs, x_dtype, pool_dtype, y_dtype) <= vmem_capacity() * 3 // 4


def _kernel(outs, rank, order, uslot, ustart, nu, x_ref, a_hbm, *rest):
    n = len(outs)
    b_hbm, (y_ref, o_ref, a_buf, *others) = rest[:n], rest[n:]
    b_bufs, sem = others[:n], others[n]
    offsets = [off // LANES for off in slice_offsets(outs)]
    chunks = [o // LANES for o in outs]

    copy = pltpu.make_async_copy(y_ref, o_ref, sem.at[0, n + 1])  # y into the output: one VMEM-local DMA
    copy.start()
    copy.wait()

    def copies(u, buf):
        slot = uslot[u]
        out = [pltpu.make_async_copy(a_hbm.at[slot], a_buf.at[buf], sem.at[buf, 0])]
        out += [
            pltpu.make_async_copy(b.at[slot], b_buf.at[buf], sem.at[buf, 1 + i])
            for i, (b, b_buf) in enumerate(zip(b_hbm, b_bufs, strict=True))
        ]
        return out

    @pl.when(nu[0] > 0)
    def _first():
        for c in copies(0, 0):
            c.start()

    def one_slot(u, carry):
        buf = jax.lax.rem(u, 2)

        @pl.when(u + 1 < nu[0])
        def _next():
            for c in copies(u + 1, 1 - buf):
                c.start()

        for c in copies(u, buf):
            c.wait()

        def one_row(k, carry):
            r = order[k]
            xr = x_ref[r].astype(ACC_DTYPE)  # [in/128, 128]
            for i in range(n):
                a = a_buf[buf, pl.ds(i * rank, rank)].astype(ACC_DTYPE)  # [R, in/128, 128]
                h = jnp.sum(a * xr[None], axis=1, keepdims=True)  # [R, 1, 128]
                h = jnp.broadcast_to(jnp.sum(h, axis=2, keepdims=True), (rank, 1, LANES))  # [R, 1, 128]
                h = h.astype(b_bufs[i].dtype).astype(ACC_DTYPE)  # rounded as the XLA backends round it
                for c0 in range(0, chunks[i], CHUNK):
                    size = min(CHUNK, chunks[i] - c0)
                    b = b_bufs[i][buf, :, pl.ds(c0, size)].astype(ACC_DTYPE)  # [R, size, 128]
                    part = jnp.sum(h * b, axis=0)  # [size, 128]
                    cols = pl.ds(offsets[i] + c0, size)
                    o_ref[r, cols] = (o_ref[r, cols].astype(ACC_DTYPE) + part).astype(o_ref.dtype)
            return carry

        jax.lax.fori_loop(ustart[u], ustart[u + 1], one_row, 0)
        return carry

    jax.lax.fori_loop(0, nu[0], one_slot, 0)


def add_lora_slices_vpu(y, x, A, Bs: Sequence, plan: VpuPlan, *, interpret=None):  # [B, sum(out_i)]
    """One decode step's LoRA for a (fused) projection on the VPU: ``A [S, n*R, in/128, 128]``, ``Bs`` n ×
    ``[S, R, out_i/128, 128]`` (:func:`to_pool` of the rank-major matrices), ``y [B, sum(out_i)]``, ``x [B, in]``,
    ``plan`` from :func:`plan_vpu` over the same B and S.

    *Semantics:* slice i of row b gets ``x[b] @ A[s][i*R:(i+1)*R].T @ Bs[i][s]`` added (f32, h rounded to the B
    pool's dtype, then y's dtype), s = the row's slot; rows without a slot return ``y[b]`` exactly."""
    rows, width = y.shape
    d_in = x.shape[1]
    rank = Bs[0].shape[1]
    outs = tuple(int(b.shape[2]) * LANES for b in Bs)
    if interpret is None:
        interpret = tiled.default_interpret()
    smem, vmem, hbm = (pl.BlockSpec(memory_space=m) for m in (pltpu.SMEM, pltpu.VMEM, pl.ANY))
    x3 = x.reshape(rows, d_in // LANES, LANES)
    y3 = y.reshape(rows, width // LANES, LANES)
    need = vmem_bytes(rows, d_in, rank, outs, x.dtype, A.dtype, y.dtype)
    adapters = min(A.shape[0], rows) * (A[0].nbytes + sum(b[0].nbytes for b in Bs))
    out = pl.pallas_call(
        lambda *refs: _kernel(outs, rank, *refs),
        out_shape=jax.ShapeDtypeStruct(y3.shape, y.dtype),
        in_specs=[smem] * 4 + [vmem, hbm, *([hbm] * len(Bs)), vmem],
        out_specs=vmem,
        scratch_shapes=[
            pltpu.VMEM((2, *A.shape[1:]), A.dtype),
            *(pltpu.VMEM((2, *b.shape[1:]), b.dtype) for b in Bs),
            pltpu.SemaphoreType.DMA((2, len(Bs) + 2)),
        ],
        input_output_aliases={4 + 1 + 1 + len(Bs): 0},  # y is the output's buffer
        compiler_params=pltpu.CompilerParams(
            vmem_limit_bytes=min(need * 5 // 4 + (8 << 20), vmem_capacity() * 7 // 8)
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * rows * rank * (len(Bs) * d_in + width),
            transcendentals=0,
            bytes_accessed=x.nbytes + 2 * y.nbytes + adapters,
        ),
        interpret=interpret,
        name="lora_decode_vpu",
    )(plan.order, plan.uslot, plan.ustart, plan.nu, x3, A, *Bs, y3)
    return out.reshape(rows, width)


__all__ = ["VpuPlan", "add_lora_slices_vpu", "fits", "from_pool", "plan_vpu", "to_pool", "vmem_bytes"]
