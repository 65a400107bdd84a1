"""The ``pallas`` backend (run interpreted on CPU, compiled by Mosaic on a TPU) equals the ``reference`` backend.

Tolerances as in test_xla.py (kernels.testing.TOLERANCE): f32 2e-5, bf16 2e-2 (atol = rtol).
Interpret mode is slow to compile, so the property test draws fewer, smaller examples.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from loraserve import kernels
from loraserve.kernels import pallas as pk
from loraserve.kernels import reference as ref
from loraserve.kernels.testing import random_lora_case, tolerance
from tests.kernels.strategies import Problem, assert_matches_reference, problems, run_all_ops
from tests.platform import INTERPRET, ON_TPU

# shrink (x's dtype out), expand (h in y's dtype), and add_lora_slices (f32 shrink, then slices):
# every kernel and dtype path, with half the compilations of running all six ops.
PALLAS_OPS = ("shrink", "expand", "add_lora_slices")


@settings(max_examples=15, deadline=None)
@given(problems(max_T=300, max_dim=40, max_S=64, max_R=64), st.sampled_from([None, 16, 32]))
def test_pallas_matches_reference(p: Problem, block_t: int | None) -> None:
    assert pk.default_interpret() == (not ON_TPU)  # interpreted on a CPU, compiled for the chip on a TPU
    got = run_all_ops(p, "pallas", PALLAS_OPS, block_t=block_t)
    assert_matches_reference(p, got, run_all_ops(p, "reference", PALLAS_OPS))


def test_active_slots_lists_each_blocks_distinct_slots() -> None:
    idx = jnp.array([3, -1, 3, 0, -1, -1, -1, -1, 5, 5, 2, 2], jnp.int32)  # 3 blocks of 4
    slots, counts, L = pk.active_slots(idx, S=6, bt=4)
    assert L == 4
    np.testing.assert_array_equal(counts, [2, 0, 2])
    # used slots first (sorted), then the last one repeated: same block index, so no new DMA
    np.testing.assert_array_equal(np.asarray(slots).reshape(3, 4), [[0, 3, 3, 3], [0, 0, 0, 0], [2, 5, 5, 5]])


def test_block_choices_follow_tpu_tiling() -> None:
    assert pk.token_block(300, [jnp.float32]) == 128
    assert pk.token_block(5, [jnp.float32]) == 8
    assert pk.token_block(5, [jnp.float32, jnp.bfloat16]) == 16  # bf16 packs 16 rows per tile
    with pytest.raises(ValueError, match="multiple of 16"):
        pk.token_block(64, [jnp.bfloat16], block_t=8)
    assert [pk.lane_block(n) for n in (14336, 4096, 1024, 384, 100)] == [2048, 2048, 1024, 384, 100]
    assert pk.lane_block(640, cap=256) == 128


def _interpret_params() -> pltpu.InterpretParams:
    # out-of-bounds reads raise; uninitialised memory (e.g. a scratch never zeroed) reads as NaN
    return pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan", detect_races=True)


@pytest.mark.cpu_only(INTERPRET)
@pytest.mark.parametrize(
    ("dtype", "T", "outs", "lane_cap"),
    [
        (jnp.float32, 37, (384,), 128),  # several in/out blocks and token blocks
        (jnp.bfloat16, 21, (256, 128, 128), 128),  # fused qkv-like slices written in place (aliased y)
    ],
)
def test_pallas_under_tpu_interpret_params(monkeypatch, dtype, T, outs, lane_cap) -> None:
    """TPU interpret mode simulates VMEM/SMEM and DMAs and checks every access."""
    if lane_cap:
        monkeypatch.setattr(pk, "MAX_BLOCK_LANES", lane_cap)
    S, R, d_in = 5, 8, 256
    c = random_lora_case(7, T=T, d_in=d_in, d_out=sum(outs), S=S, R=R, dtype=dtype, p_none=0.3)
    Bs = tuple(jnp.split(c.B, np.cumsum(outs)[:-1].tolist(), axis=2))
    A_cat = jnp.concatenate([c.A] * len(outs), axis=2)
    pltpu.reset_tpu_interpret_mode_state()
    got = pk.add_lora_slices(c.y, c.x, A_cat, Bs, c.idx, block_t=16, interpret=_interpret_params())
    want = ref.add_lora_slices(c.y, c.x, A_cat, Bs, c.idx)
    tol = tolerance(dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    none = np.asarray(c.idx) < 0
    np.testing.assert_array_equal(np.asarray(got)[none], np.asarray(c.y)[none])


def test_pallas_never_reads_unused_slots_or_padding() -> None:
    """NaN in slots no token uses and in rows without adapter never reaches the output."""
    c = random_lora_case(3, T=13, d_in=16, d_out=24, S=6, R=4)
    idx = jnp.array([1, 1, -1, 4, 1, -1, 4, 4, 1, -1, 1, 4, 1], jnp.int32)
    unused = jnp.array([0, 2, 3, 5])
    A = c.A.at[unused].set(jnp.nan)
    B = c.B.at[unused].set(jnp.nan)
    x = c.x.at[jnp.array([2, 5, 9])].set(jnp.inf)  # the idx −1 rows
    got = np.asarray(pk.add_lora(c.y, x, A, B, idx, block_t=8))
    want = np.asarray(ref.add_lora(c.y, x, A, B, idx))  # the gather never touches unused slots
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_pallas_sgmv_prefill_matches_reference() -> None:
    c = random_lora_case(11, T=150, d_in=32, d_out=48, S=9, R=16)
    seg_slots = jnp.array([4, -1, 0, 8], jnp.int32)
    seg_lens = jnp.array([40, 7, 66, 30], jnp.int32)  # 7 padding tokens at the end
    run = jax.jit(lambda *a: kernels.add_lora_sgmv(*a, backend="pallas"))
    got = np.asarray(run(c.y, c.x, c.A, c.B, seg_slots, seg_lens))
    want = np.asarray(kernels.add_lora_sgmv(c.y, c.x, c.A, c.B, seg_slots, seg_lens, backend="reference"))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(got[40:47], np.asarray(c.y)[40:47])
    np.testing.assert_array_equal(got[143:], np.asarray(c.y)[143:])
    # contiguous segments: each 128-token block touches at most 3 slots, not all 9
    idx = jnp.pad(kernels.segments_to_idx(seg_slots, seg_lens, 150), (0, 106), constant_values=-1)
    _, counts, _ = pk.active_slots(idx, S=9, bt=128)
    np.testing.assert_array_equal(counts, [3, 1])
