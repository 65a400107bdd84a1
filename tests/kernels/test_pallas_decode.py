"""The ``pallas`` backend's decode kernel (:mod:`kernels.pallas_decode`): its plan, its values against the
``reference`` backend, row isolation, one compilation for every adapter mix, and the fall-back to the tiled
kernels for shapes it does not take. Off a TPU it runs interpreted (DMAs simulated); on a
TPU, compiled by Mosaic.

Tolerances: f32 pools 2e-5 relative to the outputs' scale (the kernel sums ``x @ A`` in one product, the
reference at ``highest`` in another order: 1e-6 measured). bf16 pools: ``h`` is rounded to bf16 before the
expand, as xla-grouped does (a relative 2^-9 of each term of ``h @ B``), and bf16 outputs round once more (an
ulp is 2^-8 of the value): 2e-2 absolute plus 1e-2 relative (one ulp at most measured).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.kernels import get_backend
from loraserve.kernels import pallas_decode as pd
from loraserve.kernels import reference as ref

QKV, GATE_UP, ONE = (256, 128, 128), (384, 384), (128,)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(1, 70), st.data())
def test_the_plan_lists_each_slot_in_use_once_with_the_windows_of_its_rows(
    rows: int, slots: int, data
) -> None:
    values = data.draw(st.lists(st.integers(-2, slots + 1), min_size=rows, max_size=rows))
    plan = pd.plan_decode(np.array(values), slots)
    windows = -(-rows // pd.WIN)
    assert plan.seg_slot.shape == plan.seg_lo.shape == plan.seg_hi.shape == (max(1, min(slots, rows)),)
    assert plan.wins.shape == (max(1, min(rows, slots * windows)),)  # fixed by the batch and slot count
    valid = [v if 0 <= v < slots else -1 for v in values]
    assert plan.idx.tolist() == valid
    used = sorted({v for v in valid if v >= 0})
    (count,) = plan.count.tolist()
    assert plan.seg_slot[:count].tolist() == used  # every slot in use once, increasing
    for j, slot in enumerate(used):
        got = plan.wins[plan.seg_lo[j] : plan.seg_hi[j]].tolist()
        assert got == sorted({row // pd.WIN for row, v in enumerate(valid) if v == slot})


def _case(rows: int, slots: int, outs, rank: int, dtype, x_dtype=None, seed: int = 0):
    rng = np.random.default_rng(seed)
    d_in, n = 256, len(outs)
    x = jnp.asarray(rng.standard_normal((rows, d_in)), x_dtype or dtype)
    y = jnp.asarray(rng.standard_normal((rows, sum(outs))), x_dtype or dtype)
    a = jnp.asarray(rng.standard_normal((slots, d_in, n * rank)) / np.sqrt(d_in), dtype)
    bs = tuple(jnp.asarray(rng.standard_normal((slots, rank, o)) / np.sqrt(rank), dtype) for o in outs)
    return y, x, a, bs


MIXES = {
    "own-adapter-per-row": lambda rows, slots: np.arange(rows) % slots,
    "one-adapter-on-all": lambda rows, slots: np.full(rows, slots - 1),
    "mixed-with-none-and-outside": lambda rows, slots: np.random.default_rng(rows).integers(
        -1, slots + 2, rows
    ),
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize(
    ("rows", "outs", "dtype", "x_dtype"),
    [
        (37, QKV, jnp.float32, None),
        (64, GATE_UP, jnp.bfloat16, None),
        (5, ONE, jnp.bfloat16, jnp.float32),  # a float32 model with bf16 pools
    ],
    ids=["qkv-f32-37", "gate_up-bf16-64", "one-f32-x-bf16-pools-5"],
)
def test_matches_the_reference(mix: str, rows: int, outs, dtype, x_dtype) -> None:
    slots = 24
    y, x, a, bs = _case(rows, slots, outs, 16, dtype, x_dtype)
    plan = pd.plan_decode(MIXES[mix](rows, slots), slots)
    got = np.asarray(pd.add_lora_slices_decode(y, x, a, bs, plan), np.float32)
    want = np.asarray(ref.add_lora_slices(y, x, a, bs, jnp.asarray(plan.idx)), np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    else:
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-2)
    none = plan.idx < 0
    assert np.array_equal(got[none], np.asarray(y, np.float32)[none])  # rows without an adapter: y exactly
    if (~none).any():  # and the adapters moved the others
        assert np.abs(got[~none] - np.asarray(y, np.float32)[~none]).max() > 0.1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_a_poisoned_slot_and_row_leave_every_other_row_bit_identical(dtype) -> None:
    rows, slots = 40, 6
    y, x, a, bs = _case(rows, slots, QKV, 16, dtype, seed=3)
    row_slots = np.arange(rows) % (slots + 1) - 1  # -1 and every slot, each in several windows
    plan = pd.plan_decode(row_slots, slots)
    clean = np.asarray(pd.add_lora_slices_decode(y, x, a, bs, plan), np.float32)
    a = a.at[2].set(jnp.nan)
    bs = (bs[0].at[2].set(jnp.inf), *bs[1:])
    x = x.at[3].set(jnp.inf)  # row 3 is on slot 2 as well
    assert row_slots[3] == 2
    got = np.asarray(pd.add_lora_slices_decode(y, x, a, bs, plan), np.float32)
    others = row_slots != 2
    assert np.array_equal(got[others], clean[others])
    assert not np.isfinite(got[~others]).any()


def test_one_compilation_serves_every_adapter_mix() -> None:
    rows, slots = 32, 8
    y, x, a, bs = _case(rows, slots, QKV, 16, jnp.float32)
    step = jax.jit(pd.add_lora_slices_decode)
    mixes = [np.arange(rows) % slots, np.full(rows, 3), np.where(np.arange(rows) % 3, 5, -1)]
    for slots_of_rows in mixes:
        plan = pd.plan_decode(slots_of_rows, slots)
        want = ref.add_lora_slices(y, x, a, bs, jnp.asarray(plan.idx))
        np.testing.assert_allclose(
            step(y, x, a, bs, plan), want, rtol=0, atol=2e-5 * float(jnp.abs(want).max())
        )
    assert step._cache_size() == 1


def test_the_backend_takes_the_kernel_where_it_fits_and_the_tiled_kernels_elsewhere(monkeypatch) -> None:
    f32, bf16 = jnp.float32, jnp.bfloat16
    with monkeypatch.context() as chip:  # a v4's 16 MiB of VMEM: gate/up at batch 256 (~40 MB) does not fit
        chip.setattr(pd, "vmem_capacity", lambda: 16 << 20)
        assert not pd.fits(256, 4096, 32, (14336, 14336), bf16, bf16, bf16, bf16)
        assert pd.fits(64, 4096, 48, (4096, 1024, 1024), bf16, bf16, bf16, bf16)  # qkv at 64: ~5 MB
    assert pd.fits(64, 4096, 48, (4096, 1024, 1024), bf16, bf16, bf16, bf16)  # Llama-3-8B's qkv at batch 64
    assert pd.fits(256, 4096, 32, (14336, 14336), bf16, bf16, bf16, bf16)  # gate/up at batch 256: ~40 MB
    assert not pd.fits(8, 64, 48, (64, 16, 16), f32, f32, f32, f32)  # slices not a multiple of 128 lanes
    assert not pd.fits(8, 256, 24, (128, 128, 128), bf16, bf16, bf16, bf16)  # rank 8: half a bf16 tile
    assert pd.fits(8, 256, 24, (128, 128, 128), f32, f32, f32, f32)  # ... a whole f32 one
    assert not pd.fits(1024, 8192, 32, (28672, 28672), bf16, bf16, bf16, bf16)  # > vmem_budget()
    # through the backend either way: the plan it makes, and the same values as the reference
    backend = get_backend("pallas")
    for outs, rank in ((QKV, 16), ((24, 8, 8), 4)):
        y, x, a, bs = _case(10, 4, outs, rank, f32)
        plan = backend.plan(np.array([0, 1, 2, 3, -1, 0, 1, 2, 3, 9]), 4)
        assert isinstance(plan, pd.DecodePlan)
        np.testing.assert_array_equal(backend.row_slots(plan), [0, 1, 2, 3, -1, 0, 1, 2, 3, -1])
        want = ref.add_lora_slices(y, x, a, bs, jnp.asarray(plan.idx))
        np.testing.assert_allclose(
            backend.add_decode(y, x, a, bs, plan), want, rtol=0, atol=2e-5 * float(jnp.abs(want).max())
        )
    assert backend.plan(np.array([-1, 4, 7]), 4) is None  # no row on a slot: no LoRA code at all
    warm = backend.warmup_plans(10, 4)
    assert warm[0] is None and jax.tree.structure(warm[1]) == jax.tree.structure(plan)
    assert [v.shape for v in jax.tree.leaves(warm[1])] == [v.shape for v in jax.tree.leaves(plan)]


def test_input_and_output_chunks_give_the_whole_products(monkeypatch) -> None:
    """The kernel multiplies a window in chunks of K_CHUNK inputs (summed in f32) and CHUNK output columns; at
    128 each, the 256 inputs and 512 columns here take 2 and 4 chunks: the same values as the reference."""
    monkeypatch.setattr(pd, "K_CHUNK", 128)
    monkeypatch.setattr(pd, "CHUNK", 128)
    y, x, a, bs = _case(21, 5, QKV, 16, jnp.float32, seed=9)
    plan = pd.plan_decode(np.arange(21) % 6 - 1, 5)
    got = pd.add_lora_slices_decode(y, x, a, bs, plan)
    want = ref.add_lora_slices(y, x, a, bs, jnp.asarray(plan.idx))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(jnp.abs(want).max()))
