"""Row isolation, an invariant of every LoRA backend: whatever one slot's pools hold (NaN, ±inf, a finite value
that overflows a product), every row on another slot, and every row without an adapter, gets bit for bit the
result it gets when that slot holds healthy weights. Checked for decode (every grouped-decode variant: light
rows, heavy slots, the single-slot form), packed prefill segments and one-slot prefill, in f32 and bf16
pools, and under ``ShardedBackend`` (column- and row-parallel, two devices, in a child process).

``models/decoder.py`` keeps the rest of a step isolated (per-row gathers for DoRA, bias and vocab pools; a KV
cache that stores only finite numbers): ``tests/worker/test_row_isolation.py`` checks the whole model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve import kernels
from loraserve.kernels import grouped
from tests.conftest import TEST_XLA_FLAGS
from tests.platform import SUBPROCESS_JAX, cpp_only

T, D_IN, S, R = 12, 40, 5, 4
OUTS = (24, 8, 8)
SLOT_SHAPES = {"A_qkv": (D_IN, 3 * R), "B_q": (R, 24), "B_k": (R, 8), "B_v": (R, 8)}
B_NAMES = ("B_q", "B_k", "B_v")
POISONED = 2
POISON = np.array([np.nan, np.inf, -np.inf, 3e38], np.float32)
# slot per row: the poisoned slot on one row, on many rows (a grouped "heavy" slot), alone with base rows
IDX = {
    "mixed": [0, 1, 2, 3, 4, -1, 2, 2, 2, 0, -1, 4],
    "one-row": [0, 1, 2, 3, 4, -1, 1, 1, 3, 0, -1, 4],
    "only-poisoned": [2, -1, 2, -1, -1, 2, 2, -1, 2, -1, -1, -1],
}
SEGMENTS = [0, POISONED, -1, 4]  # four segments of three tokens
NAMES = tuple(kernels.LORA_BACKENDS)


def _values(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        k: (rng.standard_normal((S, *shape)) / np.sqrt(shape[0])).astype(np.float32)
        for k, shape in SLOT_SHAPES.items()
    }


def pools_of(backend, dtype, poison: bool) -> dict[str, jax.Array]:
    """One layer's pools in ``backend``'s layout; with ``poison`` the POISONED slot holds POISON repeated."""
    values = _values()
    out = {}
    for k, v in values.items():
        if poison:
            v = v.copy()
            v[POISONED] = np.resize(POISON, v.shape[1:])
        out[k] = jnp.stack(
            [backend.to_pool_layout(jnp.asarray(v[s]).astype(dtype), kernels.pool_kind(k)) for s in range(S)]
        )
    return out


def problem(dtype):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((T, D_IN)), jnp.float32).astype(dtype)
    y = jnp.asarray(rng.standard_normal((T, sum(OUTS))), jnp.float32).astype(dtype)
    return x, y


def _decode(backend, pools, x, y, plan):
    return jax.jit(lambda p, x, y, plan: backend.add_decode(y, x, p["A_qkv"], [p[b] for b in B_NAMES], plan))(
        pools, x, y, plan
    )


def _segments(backend, pools, x, y):
    seg = jnp.asarray(SEGMENTS, jnp.int32)
    return jax.jit(lambda p, x, y: backend.add_segments(y, x, p["A_qkv"], [p[b] for b in B_NAMES], seg))(
        pools, x, y
    )


def _one_slot(backend, pools, x, y, slot: int):
    return jax.jit(lambda p, x, y: backend.add_one_slot(y, x, p["A_qkv"], [p[b] for b in B_NAMES], slot))(
        pools, x, y
    )


def _same(got, want, rows, what: str) -> None:
    got, want = np.asarray(got, np.float32)[rows], np.asarray(want, np.float32)[rows]
    assert np.isfinite(want).all(), what
    np.testing.assert_array_equal(got, want, err_msg=what)


def _plans(backend, idx: np.ndarray) -> dict[str, object]:
    """The plan the backend makes, and for xla-grouped every compiled variant it can pick."""
    plans = {"default": backend.plan(idx, S)}
    if backend.name == "xla-grouped":
        for light in grouped.LIGHT_J:
            plans[f"light={light}"] = grouped.plan_groups(idx, S, lights=(light,), single=False)
        if len(set(idx[idx >= 0].tolist())) == 1:
            plans["single"] = grouped.plan_groups(idx, S, single=True)
    return plans


# bf16 pools where the backend has code of its own for them (the C++ kernels); the others' ops are
# dtype-generic jnp/Pallas code, and the model-level test runs them on their own
CASES = [(n, jnp.float32) for n in NAMES] + [("cpu", jnp.bfloat16)]
PARAMS = [
    pytest.param(n, d, id=f"{n}-{jnp.dtype(d).name}", marks=cpp_only if n == "cpu" else ()) for n, d in CASES
]


@pytest.mark.parametrize(("name", "dtype"), PARAMS)
def test_a_poisoned_slot_never_reaches_another_row(name: str, dtype) -> None:
    backend = kernels.get_backend(name)
    backend.check()
    healthy, poisoned = pools_of(backend, dtype, False), pools_of(backend, dtype, True)
    x, y = problem(dtype)
    for label, idx in IDX.items():
        idx = np.asarray(idx, np.int32)
        victims = idx != POISONED
        for variant, plan in _plans(backend, idx).items():
            _same(
                _decode(backend, poisoned, x, y, plan),
                _decode(backend, healthy, x, y, plan),
                victims,
                f"{name} decode {label} {variant}",
            )
        if label == "mixed":  # the poison does reach its own rows: the test compares something real
            assert not np.array_equal(
                np.asarray(_decode(backend, poisoned, x, y, plan), np.float32)[~victims],
                np.asarray(_decode(backend, healthy, x, y, plan), np.float32)[~victims],
            )
    seg_victims = np.repeat(np.asarray(SEGMENTS) != POISONED, T // len(SEGMENTS))
    _same(
        _segments(backend, poisoned, x, y), _segments(backend, healthy, x, y), seg_victims, f"{name} segments"
    )
    for slot in (-1, 0, 4):  # a one-slot prefill on another slot, or on none
        _same(
            _one_slot(backend, poisoned, x, y, slot),
            _one_slot(backend, healthy, x, y, slot),
            slice(None),
            f"{name} one slot {slot}",
        )


@pytest.mark.cpu_only(SUBPROCESS_JAX)
def test_sharded_backends_keep_rows_isolated() -> None:
    """Every backend under ShardedBackend on two devices, column- and row-parallel (child process)."""
    env = dict(os.environ)
    flags = f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count=2"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.isolation_child"],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(report) == sorted(f"{n}/{kind}" for n in NAMES for kind in ("column", "row")), report
    assert all(v == "isolated" for v in report.values()), report


# The watched row (slot 1, row 0's x and y) at several positions, beside batches that put 0..5 more rows on
# its slot (so its slot group is 1, 2, 3, 4 or 6 rows long and it sits first, inside or last in it) and the
# other rows on other slots or none.
WATCHED = 1
COMPANIONS = [
    ([1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1], 0),
    ([0, 2, 3, 1, 4, -1, 0, 2, 3, 4, -1, 0], 3),
    ([1, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1], 1),
    ([1, 1, 1, 0, 0, 0, 2, 2, 2, 3, 4, -1], 2),
    ([1, 1, 1, 1, 1, 1, 0, 2, -1, 3, 4, 0], 4),
    ([1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, 1], 11),
    ([4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 1], 11),
]
# (in, rank, outs): this file's small projection (n*R = 12: one 8-column block and 4 single columns), and
# a rank-16 one (n*R = 48: blocks of 8, 16 or 48 columns by rows at a time) with an odd `in`
SHAPES = [(D_IN, R, OUTS), (67, 16, (64, 16, 16))]
# xla-grouped serves a row in place (batched over slots) or in its slot's loop by the plan the batch
# gets: two XLA products whose roundings differ by an ulp or two (absolute, on values of order 1;
# docs/kernels.md); every other backend is batch-invariant to the bit
BATCH_VARIANT = {"xla-grouped": 1e-6}


@pytest.mark.parametrize("shape", SHAPES, ids=["r4", "r16"])
@pytest.mark.parametrize(("name", "dtype"), PARAMS)
def test_a_rows_result_does_not_depend_on_its_batch(name: str, dtype, shape) -> None:
    """Batch invariance: one row's delta is the same bits whatever the rest of the batch is (how many rows
    share its slot, where it sits in that group, what the other rows hold), so a tenant's output never
    depends on who else is being served, and a greedy run is reproducible under any traffic."""
    backend = kernels.get_backend(name)
    backend.check()
    d_in, r, outs = shape
    rng = np.random.default_rng(7)
    a = rng.standard_normal((S, d_in, len(outs) * r)) / np.sqrt(d_in)
    bs = [rng.standard_normal((S, r, out)) / np.sqrt(r) for out in outs]

    def pool(v, kind):
        return jnp.stack(
            [backend.to_pool_layout(jnp.asarray(v[s], jnp.float32).astype(dtype), kind) for s in range(S)]
        )

    a_pool, b_pools = pool(a, "A"), [pool(b, "B") for b in bs]
    x = jnp.asarray(rng.standard_normal((T, d_in)), jnp.float32).astype(dtype)
    y = jnp.asarray(rng.standard_normal((T, sum(outs))), jnp.float32).astype(dtype)
    step = jax.jit(lambda a, bs, x, y, plan: backend.add_decode(y, x, a, bs, plan))
    got = {}
    for idx, at in COMPANIONS:
        idx = np.asarray(idx, np.int32)
        assert idx[at] == WATCHED
        out = step(a_pool, b_pools, x.at[at].set(x[0]), y.at[at].set(y[0]), backend.plan(idx, S))
        got[(tuple(idx.tolist()), at)] = np.asarray(out, np.float32)[at]
    first = next(iter(got.values()))
    assert not np.array_equal(first, np.asarray(y[0], np.float32))  # the adapter does move the row
    for key, row in got.items():
        np.testing.assert_allclose(
            row, first, rtol=0, atol=BATCH_VARIANT.get(name, 0), err_msg=f"{name}: {key}"
        )
