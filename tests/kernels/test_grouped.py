"""kernels.grouped: the decode path of the XLA backend computes what the reference computes, for every
grouping variant and any slot mix, and new mixes never compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.kernels import grouped, reference
from loraserve.kernels.testing import count_compilations, tolerance

DTYPES = (jnp.float32, jnp.bfloat16)


def _problem(seed: int, T: int, d_in: int, S: int, R: int, outs: tuple[int, ...], dtype):
    rng = np.random.default_rng(seed)

    def arr(shape, scale=1.0):
        return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype))  # host-side

    x = arr((T, d_in))
    A = arr((S, d_in, len(outs) * R), d_in**-0.5)  # [S, in, n*R], docs/design.md §6
    Bs = tuple(arr((S, R, o), R**-0.5) for o in outs)  # [S, R, out_i]
    y = arr((T, sum(outs)))
    return x, A, Bs, y


def _weights_first(A, Bs):
    return jnp.swapaxes(A, 1, 2), tuple(jnp.swapaxes(B, 1, 2) for B in Bs)


# the reference and the layout change jitted: one program a shape, not a dozen eager ops (compile-bound tests)
_reference = jax.jit(lambda *a: reference.add_lora_slices(*a).astype(jnp.float32))
_run_weights_first = jax.jit(
    lambda y, x, A, Bs, plan: grouped.add_lora_slices_grouped(y, x, *_weights_first(A, Bs), plan)
)


@settings(max_examples=20, deadline=None)
@given(
    T=st.integers(1, 40),
    d_in=st.integers(1, 48),
    S=st.integers(1, 20),
    R=st.integers(1, 16),
    outs=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    variant=st.sampled_from(grouped.VARIANTS),
    skew=st.sampled_from(["uniform", "one-hot-slot", "none"]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference_for_every_variant(T, d_in, S, R, outs, variant, skew, dtype, seed) -> None:
    light, single = variant
    x, A, Bs, y = _problem(seed, T, d_in, S, R, outs, dtype)
    rng = np.random.default_rng(seed + 1)
    idx = rng.integers(-1, S, size=T)
    if skew == "one-hot-slot":  # most rows on one slot: heavy slots next to light ones
        idx = np.where(rng.random(T) < 0.7, rng.integers(0, S), idx)
    elif skew == "none":
        idx[:] = -1
    if single:  # the single variant serves batches with one slot in use
        idx = np.where(idx >= 0, idx[np.argmax(idx >= 0)], -1)
    plan = grouped.plan_groups(idx, S, lights=(light,), single=single)
    want = np.asarray(_reference(y, x, A, Bs, jnp.asarray(idx, jnp.int32)))
    if plan is None:
        assert (idx < 0).all()
        return
    assert plan.variant == variant
    got = np.asarray(_run_weights_first(y, x, A, Bs, plan)).astype(np.float32)
    tol = tolerance(dtype)
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    none = idx < 0
    np.testing.assert_array_equal(got[none], np.asarray(y).astype(np.float32)[none])  # untouched, bit for bit


def test_plan_picks_the_cheap_grouping() -> None:
    S, T = 16, 16
    distinct = grouped.plan_groups(np.arange(T) % S, S)
    assert distinct.light == 1 and int(distinct.n_heavy) == 0  # one row per slot: all in place
    one = grouped.plan_groups(np.where(np.arange(T) % 3, 5, -1), S)
    assert one.variant == (0, True) and int(one.heavy[0]) == 5  # one slot in use: straight-line code
    two = grouped.plan_groups(np.arange(T) % 2, S)
    assert two.variant == (0, False) and int(two.n_heavy) == 2  # two busy slots: the heavy loop
    skew = grouped.plan_groups(np.array([3] * 10 + [1, 2, 4, 5, 6, 7]), S)
    assert skew.light == 1 and int(skew.n_heavy) == 1 and int(skew.heavy[0]) == 3
    assert skew.flat[0] == -1 and skew.rows[1, 0] == 10  # slot 1's row sits at (1, 0)
    assert grouped.plan_groups(np.full(T, -1), S) is None
    assert grouped.plan_groups(np.full(T, S + 3), S) is None  # outside [0, S): no adapter
    four = grouped.plan_groups(np.arange(T) % 4, S)
    assert four.light == 4 and int(four.n_heavy) == 0


@pytest.mark.parametrize(("light", "single"), grouped.VARIANTS)
def test_new_mixes_never_compile(light: int, single: bool) -> None:
    T, S, R, outs = 12, 6, 4, (16, 8)
    x, A, Bs, y = _problem(0, T, 24, S, R, outs, jnp.float32)
    At, Bts = _weights_first(A, Bs)
    step = jax.jit(grouped.add_lora_slices_grouped)
    step(y, x, At, Bts, grouped.empty_plan(T, S, light, single)).block_until_ready()  # warm-up
    rng = np.random.default_rng(light)
    plans = []
    for _ in range(8):
        idx = rng.integers(-1, S, size=T)
        if single:
            idx = np.where(idx >= 0, rng.integers(0, S), -1)
        plan = grouped.plan_groups(idx, S, lights=(light,), single=single)
        if plan is not None:
            plans.append(plan)
    with count_compilations() as count:
        outs_ = [step(y, x, At, Bts, p) for p in plans]
        jax.block_until_ready(outs_)
    assert int(count) == 0


def test_shape_mismatch_is_a_clear_error() -> None:
    x, A, Bs, y = _problem(0, 4, 8, 2, 2, (6,), jnp.float32)
    At, Bts = _weights_first(A, Bs)
    plan = grouped.plan_groups(np.zeros(4, int), 2)
    with pytest.raises(ValueError, match="shapes do not line up"):
        grouped.add_lora_slices_grouped(y[:, :-1], x, At, Bts, plan)
