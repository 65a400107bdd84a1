"""The ``pallas`` backend's decode kernel (:mod:`kernels.pallas_decode`): its plan and slot groups, its values
against the ``reference`` backend, row isolation and batch invariance inside a group of slots, one compilation
for every adapter mix, and the XLA fall-back for shapes it does not take. Off a TPU it runs interpreted (DMAs
simulated); on a TPU, compiled by Mosaic.

The kernel reads rank-major pools (``A [S, n*R, in]``, ``B [S, R, out]``: :class:`kernels.PallasBackend`);
the reference reads the canonical ``A [S, in, n*R]``. Tolerances: f32 pools 2e-5 relative to the outputs'
scale (the kernel sums ``x @ A`` in K_CHUNK pieces, the reference at ``highest`` in another order: 1e-6
measured). bf16 pools: ``h`` is rounded to bf16 before the expand, as xla-grouped does (a relative 2^-9 of each
term of ``h @ B``), and bf16 outputs round once more (an ulp is 2^-8 of the value): 2e-2 absolute plus 1e-2
relative (one ulp at most measured).
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
# one compilation per shape for the whole file (interpreted, a call's program is most of its cost)
decode = jax.jit(pd.add_lora_slices_decode)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 200), st.integers(1, 70), st.sampled_from([8, 16, 64, 128, 256]), st.data())
def test_the_plan_flags_each_slot_in_use_and_the_groups_hold_them_in_order(
    rows: int, slots: int, rank: int, data
) -> None:
    values = data.draw(st.lists(st.integers(-2, slots + 1), min_size=rows, max_size=rows))
    plan = pd.plan_decode(np.array(values), slots)
    valid = [v if 0 <= v < slots else -1 for v in values]
    assert plan.idx.tolist() == valid
    assert plan.used.shape == (slots,)  # fixed by the slot count
    used = sorted({v for v in valid if v >= 0})
    assert np.flatnonzero(plan.used).tolist() == used
    group = pd.group_size(rank)
    assert group * rank == max(rank, 128)  # one group fills the MXU's 128 rows (or is one slot)
    groups, count, flags = pd.groups_in_use(jnp.asarray(plan.used), group)
    ng = -(-slots // group)
    assert groups.shape == (ng,) and flags.shape == (ng * group,)  # fixed by the slot count too
    live = sorted({s // group for s in used})
    assert int(count[0]) == len(live) and groups[: len(live)].tolist() == live
    assert set(groups.tolist()) <= set(live or [int(groups[0])])  # the padding repeats a live group


def _case(rows: int, slots: int, outs, rank: int, dtype, x_dtype=None, seed: int = 0, d_in: int = 256):
    """``(y, x, A canonical [S, in, n*R], A rank-major [S, n*R, in], Bs)``."""
    rng = np.random.default_rng(seed)
    n = len(outs)
    x = jnp.asarray(rng.standard_normal((rows, d_in)), x_dtype or dtype)
    y = jnp.asarray(rng.standard_normal((rows, sum(outs))), x_dtype or dtype)
    a = jnp.asarray(rng.standard_normal((slots, d_in, n * rank)) / np.sqrt(d_in), dtype)
    bs = tuple(jnp.asarray(rng.standard_normal((slots, rank, o)) / np.sqrt(rank), dtype) for o in outs)
    return y, x, a, jnp.swapaxes(a, 1, 2), bs


def _close(got, want, dtype) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    else:
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-2)


MIXES = {
    "own-adapter-per-row": lambda rows, slots: np.arange(rows) % slots,
    "one-adapter-on-all": lambda rows, slots: np.full(rows, slots - 1),
    "mixed-with-none-and-outside": lambda rows, slots: np.random.default_rng(rows).integers(
        -1, slots + 2, rows
    ),
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize(
    ("rows", "outs", "rank", "dtype", "x_dtype"),
    [
        (37, QKV, 16, jnp.float32, None),
        (64, GATE_UP, 16, jnp.bfloat16, None),
        (5, ONE, 16, jnp.bfloat16, jnp.float32),  # a float32 model with bf16 pools
        (23, QKV, 8, jnp.float32, None),  # 16 slots a group
        (19, GATE_UP, 64, jnp.bfloat16, None),  # 2 slots a group
    ],
    ids=["qkv-f32-37", "gate_up-bf16-64", "one-f32-x-bf16-pools-5", "qkv-f32-r8", "gate_up-bf16-r64"],
)
def test_matches_the_reference(mix: str, rows: int, outs, rank: int, dtype, x_dtype) -> None:
    slots = 24  # one to three groups, the last one partial at rank 16
    y, x, a, a_t, bs = _case(rows, slots, outs, rank, dtype, x_dtype)
    plan = pd.plan_decode(MIXES[mix](rows, slots), slots)
    got = np.asarray(decode(y, x, a_t, bs, plan), np.float32)
    _close(got, ref.add_lora_slices(y, x, a, bs, jnp.asarray(plan.idx)), dtype)
    none = plan.idx < 0
    assert np.array_equal(got[none], np.asarray(y, np.float32)[none])  # rows without an adapter: y exactly
    if (~none).any():  # and the adapters moved the others
        assert np.abs(got[~none] - np.asarray(y, np.float32)[~none]).max() > 0.1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_a_poisoned_slot_and_row_leave_every_other_row_bit_identical(dtype) -> None:
    """Slot 2 shares its group (slots 0-7 at rank 16) with every other slot in use: its NaN A and inf B (zeroed
    by the backend's write, as every B reaches the pool) and an inf in one of its rows' x stay on its rows."""
    rows, slots = 40, 6  # the invariance test's shapes but for the slots
    backend = get_backend("pallas")
    y, x, _, a_t, bs = _case(rows, slots, QKV, 16, dtype, seed=3)
    row_slots = np.arange(rows) % (slots + 1) - 1  # -1 and every slot
    plan = pd.plan_decode(row_slots, slots)
    clean = np.asarray(decode(y, x, a_t, bs, plan), np.float32)
    a_t = a_t.at[2].set(jnp.nan)
    poisoned = jnp.full(bs[0].shape[1:], jnp.inf, dtype).at[0, :3].set(-jnp.inf).at[1, 0].set(jnp.nan)
    b_pool = bs[0].at[2].set(backend.to_pool_layout(poisoned, "B"))
    assert np.array_equal(np.asarray(b_pool[2], np.float32), np.zeros(b_pool.shape[1:]))
    x = x.at[3].set(jnp.inf)  # row 3 is on slot 2 as well
    assert row_slots[3] == 2
    got = np.asarray(decode(y, x, a_t, (b_pool, *bs[1:]), plan), np.float32)
    others = row_slots != 2
    assert np.array_equal(got[others], clean[others])
    assert not np.isfinite(got[~others]).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_a_rows_result_does_not_depend_on_its_batch(dtype) -> None:
    """Batch invariance inside the kernel: row 0 on slot 5 gets the same bits alone, with its whole group
    (slots 0-7) in use, with every slot of three groups in use, and with many rows on its own slot."""
    rows, slots = 40, 24
    y, x, _, a_t, bs = _case(rows, slots, QKV, 16, dtype, seed=5)
    mixes = [
        np.r_[5, np.full(rows - 1, -1)],
        np.r_[5, np.arange(rows - 1) % 8],
        np.r_[5, np.arange(rows - 1) % slots],
        np.r_[5, np.full(rows - 1, 5)],
    ]
    got = [np.asarray(decode(y, x, a_t, bs, pd.plan_decode(m, slots)))[0] for m in mixes]
    assert not np.array_equal(got[0], np.asarray(y[0]))
    for other in got[1:]:
        assert np.array_equal(other, got[0])


def test_one_compilation_serves_every_adapter_mix() -> None:
    rows, slots = 32, 20
    y, x, a, a_t, bs = _case(rows, slots, QKV, 16, jnp.float32)
    step = jax.jit(lambda *args: pd.add_lora_slices_decode(*args))  # a cache of its own (not decode's)
    mixes = [np.arange(rows) % slots, np.full(rows, 3), np.where(np.arange(rows) % 3, 17, -1)]
    for slots_of_rows in mixes:
        plan = pd.plan_decode(slots_of_rows, slots)
        want = ref.add_lora_slices(y, x, a, bs, jnp.asarray(plan.idx))
        _close(step(y, x, a_t, bs, plan), want, jnp.float32)
    assert step._cache_size() == 1


def test_the_backend_takes_the_kernel_where_it_fits_and_xla_elsewhere(monkeypatch) -> None:
    f32, bf16 = jnp.float32, jnp.bfloat16
    with monkeypatch.context() as chip:  # a v4's 16 MiB of VMEM: gate/up at batch 256 (~45 MB) does not fit
        chip.setattr(pd, "vmem_capacity", lambda: 16 << 20)
        assert not pd.fits(256, 4096, 32, (14336, 14336), bf16, bf16, bf16, bf16)
        assert not pd.fits(64, 4096, 48, (4096, 1024, 1024), bf16, bf16, bf16, bf16)  # 8B's qkv at 64: 13 MB
        assert pd.fits(64, 2048, 48, (2048, 512, 512), bf16, bf16, bf16, bf16)  # a 1B's at 64: ~7 MB
    assert pd.fits(64, 4096, 48, (4096, 1024, 1024), bf16, bf16, bf16, bf16)  # Llama-3-8B's qkv at batch 64
    assert pd.fits(256, 4096, 32, (14336, 14336), bf16, bf16, bf16, bf16)  # gate/up at batch 256: ~45 MB
    assert not pd.fits(8, 64, 48, (64, 16, 16), f32, f32, f32, f32)  # slices not a multiple of 128 lanes
    assert not pd.fits(8, 256, 24, (128, 128, 128), bf16, bf16, bf16, bf16)  # rank 8: half a bf16 tile
    assert pd.fits(8, 256, 24, (128, 128, 128), f32, f32, f32, f32)  # ... a whole f32 one
    assert not pd.fits(1024, 8192, 32, (28672, 28672), bf16, bf16, bf16, bf16)  # > vmem_budget()
    # through the backend either way: its pools, the plan it makes, and the same values as the reference
    backend = get_backend("pallas")
    assert backend.slot_shape((256, 48), "A") == (48, 256) and backend.slot_shape((16, 128), "B") == (16, 128)
    for outs, rank in ((QKV, 16), ((24, 8, 8), 4)):
        y, x, a, a_t, bs = _case(10, 4, outs, rank, f32)
        plan = backend.plan(np.array([0, 1, 2, 3, -1, 0, 1, 2, 3, 9]), 4)
        assert isinstance(plan, pd.DecodePlan)
        np.testing.assert_array_equal(backend.row_slots(plan), [0, 1, 2, 3, -1, 0, 1, 2, 3, -1])
        want = ref.add_lora_slices(y, x, a, bs, jnp.asarray(plan.idx))
        _close(backend.add_decode(y, x, a_t, bs, plan), want, f32)
        for slot in (2, -1):  # prefill: every row on one slot
            idx = jnp.full(10, slot, jnp.int32)
            _close(
                backend.add_one_slot(y, x, a_t, bs, jnp.int32(slot)),
                ref.add_lora_slices(y, x, a, bs, idx),
                f32,
            )
    assert backend.plan(np.array([-1, 4, 7]), 4) is None  # no row on a slot: no LoRA code at all
    warm = backend.warmup_plans(10, 4)
    assert warm[0] is None and jax.tree.structure(warm[1]) == jax.tree.structure(plan)
    assert [v.shape for v in jax.tree.leaves(warm[1])] == [v.shape for v in jax.tree.leaves(plan)]


def test_row_input_and_output_chunks_give_the_whole_products(monkeypatch) -> None:
    """The kernel multiplies ROW_CHUNK rows at a time, in chunks of K_CHUNK inputs (summed in f32) and COLS
    output columns; at 16 rows and 128 lanes, the 37 rows (48 computed), 256 inputs and 512 columns here take
    3, 2 and 4 chunks: the same values as the reference."""
    monkeypatch.setattr(pd, "ROW_CHUNK", 16)
    monkeypatch.setattr(pd, "K_CHUNK", 128)
    monkeypatch.setattr(pd, "COLS", 128)
    y, x, a, a_t, bs = _case(37, 13, QKV, 16, jnp.float32, seed=9)
    plan = pd.plan_decode(np.arange(37) % 14 - 1, 13)
    got = pd.add_lora_slices_decode(y, x, a_t, bs, plan)
    _close(got, ref.add_lora_slices(y, x, a, bs, jnp.asarray(plan.idx)), jnp.float32)
