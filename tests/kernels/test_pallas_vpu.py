"""The VPU decode kernel (``kernels.pallas_vpu``, an experiment of #56): interpreted on a CPU, compiled by Mosaic
on a TPU; and lowered for a TPU here (``jax.export``), which runs the Pallas → Mosaic lowering and its rules.

* values: each row gets ``y + (x A_s^T) B_s`` of its own slot (f32 references in numpy; f32 pools within 2e-5,
  the sums are ordered differently; bf16 pools within a bf16 rounding of h and of the output), rows without a
  slot keep y's bits; several rows on one slot, slots in any order, fused slices (qkv);
* isolation: NaN and inf in one slot's A and B change its rows only (every other row bit-identical);
* batch invariance: a row's result is the same bits alone and in any batch;
* it lowers for a TPU at 8B widths (on the chip too: ``jax.export`` needs no device), and shapes whose slices
  would start inside an output tile do not fit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.kernels import pallas_vpu as pv

S, R = 6, 16


def _pools(rng, d_in, outs, dtype, num_slots=S):
    n = len(outs)
    a = rng.standard_normal((num_slots, n * R, d_in)).astype(np.float32) / np.sqrt(d_in)
    bs = [rng.standard_normal((num_slots, R, o)).astype(np.float32) / np.sqrt(R) for o in outs]
    a_pool = jnp.asarray(np.stack([pv.to_pool(m) for m in a]), dtype)
    b_pools = tuple(jnp.asarray(np.stack([pv.to_pool(m) for m in b]), dtype) for b in bs)
    return a, bs, a_pool, b_pools


def _reference(y, x, a, bs, slots, h_dtype):
    out = np.asarray(y, np.float32).copy()
    off = 0
    for i, b in enumerate(bs):
        o = b.shape[2]
        for r, s in enumerate(slots):
            if s < 0:
                continue
            h = x[r].astype(np.float32) @ a[s, i * R : (i + 1) * R].T
            h = np.asarray(jnp.asarray(h).astype(h_dtype).astype(jnp.float32))
            out[r, off : off + o] += h @ b[s]
        off += o
    return out


def _run(y, x, a_pool, b_pools, slots, num_slots=S):
    return np.asarray(
        pv.add_lora_slices_vpu(y, x, a_pool, b_pools, pv.plan_vpu(slots, num_slots)), np.float32
    )


@pytest.mark.parametrize(("dtype", "atol"), [(jnp.float32, 2e-5), (jnp.bfloat16, 0.05)], ids=["f32", "bf16"])
@pytest.mark.parametrize("outs", [(256,), (2048, 2048, 2048)], ids=["one", "fused"])
def test_matches_the_reference(dtype, atol: float, outs) -> None:
    rng = np.random.default_rng(0)
    d_in, rows = 256, 9
    assert pv.fits(rows, d_in, R, outs, dtype, dtype, dtype)  # slices start on the output's sublane tiles
    a, bs, a_pool, b_pools = _pools(rng, d_in, outs, dtype)
    x = jnp.asarray(rng.standard_normal((rows, d_in)), dtype)
    y = jnp.asarray(rng.standard_normal((rows, sum(outs))), dtype)
    slots = np.array([3, -1, 0, 3, 5, 1, -1, 3, 2], np.int32)  # shared slots, base rows, any order
    got = _run(y, x, a_pool, b_pools, slots)
    want = _reference(
        np.asarray(y, np.float32),
        np.asarray(x, np.float32),
        np.asarray(jnp.asarray(a, dtype), np.float32),
        [np.asarray(jnp.asarray(b, dtype), np.float32) for b in bs],
        slots,
        dtype,
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    base = slots < 0
    assert (got[base] == np.asarray(y, np.float32)[base]).all()  # rows without a slot: y's bits


def test_a_poisoned_slot_changes_its_rows_only_and_rows_are_batch_invariant() -> None:
    rng = np.random.default_rng(1)
    d_in, outs = 256, (256,)
    _, _, a_pool, b_pools = _pools(rng, d_in, outs, jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, d_in)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
    slots = np.array([0, 2, 4, 2, -1, 1, 4, 0], np.int32)
    clean = _run(y, x, a_pool, b_pools, slots)
    bad_a = a_pool.at[2, 3, 1, 7].set(jnp.nan)
    bad_b = b_pools[0].at[2, 5, 0, 9].set(jnp.inf)
    poisoned = _run(y, x, bad_a, (bad_b,), slots)
    mine = slots == 2
    assert np.isnan(poisoned[mine]).any()
    assert (poisoned[~mine] == clean[~mine]).all()  # every other row bit-identical
    for r in range(8):  # alone: the same bits
        one = _run(y[r : r + 1], x[r : r + 1], a_pool, b_pools, slots[r : r + 1])
        assert (one[0] == clean[r]).all(), r


def test_the_plan_sorts_rows_by_slot() -> None:
    plan = pv.plan_vpu(np.array([3, -1, 0, 3, 9, 0]), 4)  # 9: outside the pool, no slot
    assert plan.nu.tolist() == [2]
    assert plan.uslot[:2].tolist() == [0, 3]
    assert plan.order[:4].tolist() == [2, 5, 0, 3] and plan.ustart[:3].tolist() == [0, 2, 4]
    empty = pv.plan_vpu(np.full(4, -1), 4)
    assert empty.nu.tolist() == [0] and empty.ustart.tolist() == [0] * 5


@pytest.mark.parametrize(
    ("dtype", "outs"),
    [(jnp.float32, (14336,)), (jnp.bfloat16, (14336,)), (jnp.float32, (4096, 1024, 1024))],
    ids=["up-f32", "up-bf16", "qkv-f32"],
)
def test_lowers_for_tpu(dtype, outs) -> None:
    rows, d_in, slots = 64, 4096, 64
    assert pv.fits(rows, d_in, R, outs, dtype, dtype, dtype)
    sds = jax.ShapeDtypeStruct
    f = functools.partial(pv.add_lora_slices_vpu, interpret=False)
    plan = pv.VpuPlan(
        sds((rows,), jnp.int32), sds((rows,), jnp.int32), sds((rows + 1,), jnp.int32), sds((1,), jnp.int32)
    )
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(
        sds((rows, sum(outs)), dtype),
        sds((rows, d_in), dtype),
        sds((slots, len(outs) * R, d_in // 128, 128), dtype),
        tuple(sds((slots, R, o // 128, 128), dtype) for o in outs),
        plan,
    )
    assert exported.mlir_module().count("tpu_custom_call") == 1


def test_slices_that_start_inside_an_output_tile_do_not_fit() -> None:
    """bf16 qkv at 8B widths: k starts at 4096 lanes (32 rows of 128, two bf16 tiles), v at 5120 (40: inside
    the third tile): refused, where f32 (8-row tiles) takes it."""
    outs = (4096, 1024, 1024)
    assert not pv.fits(64, 4096, R, outs, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)
    assert pv.fits(64, 4096, R, outs, jnp.float32, jnp.float32, jnp.float32)
