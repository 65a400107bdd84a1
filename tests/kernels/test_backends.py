"""LoRA backend objects (kernels.backends): every backend's pool layout and host→pool conversion round-trip
(write a slot, read it back, and through the backend's ops == the reference on the canonical arrays); the
plan of a batch without adapter rows is None; the warm-up plans cover every compiled decode variant; each
``--kernel-backend`` name maps to its object.

Tolerances: ``kernels.testing.tolerance`` of the pool dtype (f32 2e-5, bf16 2e-2), values of order 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve import kernels
from loraserve.kernels import (
    CpuBackend,
    PallasBackend,
    ReferenceBackend,
    XlaGroupedBackend,
    XlaOneHotBackend,
    cpu,
    reference,
)
from loraserve.kernels.testing import count_compilations, tolerance
from tests.platform import ON_TPU, backends

T, D_IN, S, R = 12, 40, 5, 4
OUTS = (24, 8, 8)  # a fused projection of three modules (q, k, v)
SLOT_SHAPES = {"A_qkv": (D_IN, 3 * R), "B_q": (R, 24), "B_k": (R, 8), "B_v": (R, 8)}
B_NAMES = ("B_q", "B_k", "B_v")
NAMES = tuple(kernels.LORA_BACKENDS)
# the ops run: `cpu` (the C++ kernels, XLA:CPU custom calls) only on a CPU
RUNNABLE = backends(*NAMES)


def _values(seed: int) -> dict[str, np.ndarray]:
    """Canonical values of all S slots, ``[S, *slot shape]``; scaled so outputs are of order 1."""
    rng = np.random.default_rng(seed)
    return {
        k: (rng.standard_normal((S, *shape)) / np.sqrt(shape[0])).astype(np.float32)
        for k, shape in SLOT_SHAPES.items()
    }


@jax.jit
def _put(pool, slot, value):
    return pool.at[slot].set(value)


def _written(backend, values: dict[str, np.ndarray], dtype) -> dict[str, jax.Array]:
    """One layer of zeroed pools with every slot written through ``to_pool_layout`` (as SlotPools does)."""
    (pools,) = backend.init_pools(SLOT_SHAPES, 1, S, dtype)
    for k, pool in pools.items():
        assert (
            pool.shape == (S, *backend.slot_shape(SLOT_SHAPES[k], kernels.pool_kind(k)))
            and pool.dtype == dtype
        )
        assert not np.asarray(pool, np.float32).any()  # zeroed: every slot adds exactly 0
        for s in range(S):
            pool = _put(
                pool, s, backend.to_pool_layout(jnp.asarray(values[k][s]).astype(dtype), kernels.pool_kind(k))
            )
        pools[k] = pool
    return pools


def _problem(seed: int, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, D_IN)), jnp.float32).astype(dtype)
    y = jnp.asarray(rng.standard_normal((T, sum(OUTS))), jnp.float32).astype(dtype)
    idx = np.array([0, 1, 2, 3, 4, -1, 2, 2, 2, 0, -1, 4], np.int32)  # every slot, two rows without
    return x, y, idx


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", RUNNABLE)
def test_pool_layout_round_trips_through_the_ops(name: str, dtype) -> None:
    backend = kernels.get_backend(name)
    values = _values(0)
    pools = _written(backend, values, dtype)
    for k, pool in pools.items():  # read back: the inverse conversion gives the slot values exactly
        for s in range(S):
            got = np.asarray(backend.from_pool_layout(pool[s], kernels.pool_kind(k)).astype(jnp.float32))
            np.testing.assert_array_equal(
                got, np.asarray(jnp.asarray(values[k][s]).astype(dtype), np.float32)
            )
    x, y, idx = _problem(1, dtype)
    a_ref = jnp.asarray(values["A_qkv"]).astype(dtype)  # the canonical arrays the reference reads
    bs_ref = tuple(jnp.asarray(values[k]).astype(dtype) for k in B_NAMES)
    want = np.asarray(reference.add_lora_slices(y, x, a_ref, bs_ref, jnp.asarray(idx)), np.float32)
    bs = tuple(pools[k] for k in B_NAMES)
    got = np.asarray(jax.jit(backend.add_decode)(y, x, pools["A_qkv"], bs, backend.plan(idx, S)), np.float32)
    tol = tolerance(dtype)
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    none = idx < 0
    np.testing.assert_array_equal(got[none], np.asarray(y, np.float32)[none])  # untouched, bit for bit
    moved = np.abs(got[~none] - np.asarray(y, np.float32)[~none]).max(axis=1)
    assert moved.min() > 0.05  # every adapter row really changed: the comparison above proves something
    one_slot = jax.jit(backend.add_one_slot)
    for slot in (0, 3, S - 1):
        full = jnp.full((T,), slot, jnp.int32)
        want = np.asarray(reference.add_lora_slices(y, x, a_ref, bs_ref, full), np.float32)
        got = np.asarray(one_slot(y, x, pools["A_qkv"], bs, jnp.int32(slot)), np.float32)
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"one slot {slot}")
    got = np.asarray(one_slot(y, x, pools["A_qkv"], bs, jnp.int32(-1)), np.float32)
    np.testing.assert_array_equal(got, np.asarray(y, np.float32))  # slot -1: y exactly


@pytest.mark.parametrize("name", NAMES)
def test_plan_of_a_batch_without_adapter_rows_is_none(name: str) -> None:
    backend = kernels.get_backend(name)
    assert backend.plan(np.full(8, -1, np.int32), S) is None
    assert backend.plan(np.array([S, S + 3, -1, -7], np.int32), S) is None  # outside [0, S): no adapter
    assert backend.plan(np.array([-1, -1, 2, -1], np.int32), S) is not None


@pytest.mark.parametrize("name", RUNNABLE)
def test_warmup_plans_compile_every_decode_variant(name: str) -> None:
    """After the warm-up plans, decode batches of any slot mix compile nothing (docs/design.md §5)."""
    backend = kernels.get_backend(name)
    pools = _written(backend, _values(2), jnp.float32)
    x, y, _ = _problem(3, jnp.float32)
    bs = tuple(pools[k] for k in B_NAMES)

    @jax.jit
    def step(y, x, a, bs, plan):  # what the model's decode does per projection
        return y if plan is None else backend.add_decode(y, x, a, bs, plan)

    warm = backend.warmup_plans(T, S)
    assert warm[0] is None and len(warm) >= 2
    for plan in warm:  # warm-up plans have no adapter rows: they add nothing
        np.testing.assert_array_equal(np.asarray(step(y, x, pools["A_qkv"], bs, plan)), np.asarray(y))
    rng = np.random.default_rng(4)
    mixes = [
        np.arange(T) % S,  # distinct slots
        np.where(np.arange(T) % 3, 2, -1),  # one slot
        np.array([1] * 8 + [0, 2, 3, 4]),  # one heavy slot and light ones
        np.arange(T) % 2,  # two busy slots
        np.full(T, -1),  # no adapter at all
        *(rng.integers(-1, S, size=T) for _ in range(4)),
    ]
    plans = [backend.plan(m.astype(np.int32), S) for m in mixes]
    with count_compilations() as count:
        outs = [step(y, x, pools["A_qkv"], bs, p) for p in plans]
        jax.block_until_ready(outs)
    assert count.compilations == 0, count.names
    a_ref, bs_ref = jnp.asarray(_values(2)["A_qkv"]), tuple(jnp.asarray(_values(2)[k]) for k in B_NAMES)
    for m, out in zip(mixes, outs, strict=True):  # and every one computed its own mix
        want = reference.add_lora_slices(y, x, a_ref, bs_ref, jnp.asarray(m, jnp.int32))
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_kernel_backend_names_map_to_their_objects() -> None:
    expected = {
        "cpu": CpuBackend,
        "xla": XlaGroupedBackend,  # the worker's `xla` has always been the grouped decode
        "xla-grouped": XlaGroupedBackend,
        "xla-onehot": XlaOneHotBackend,
        "pallas": PallasBackend,
        "reference": ReferenceBackend,
    }
    assert set(kernels.KERNEL_BACKENDS) == {"auto", *expected}
    assert kernels.ALIASES == {"xla": "xla-grouped"}
    for name, cls in expected.items():
        assert type(kernels.get_backend(name)) is cls
        # resolving `cpu` builds the C++ kernels (XLA:CPU custom calls): nothing a TPU program can use
        if name != "cpu" or not ON_TPU:
            assert kernels.resolve_backend(name) == cls()
    assert {str(b()) for b in expected.values()} == set(kernels.LORA_BACKENDS)
    auto = kernels.resolve_backend("auto")
    assert auto == (CpuBackend() if cpu.available() else PallasBackend() if ON_TPU else XlaGroupedBackend())
    # equal and hashable by class: static jit arguments that never recompile for a fresh instance
    assert hash(CpuBackend()) == hash(CpuBackend()) and CpuBackend() != XlaGroupedBackend()
    assert {XlaGroupedBackend(): 1}[kernels.get_backend("xla")] == 1


def test_unknown_backend_name_is_a_clear_error() -> None:
    listed = "expected one of auto, cpu, pallas, reference, xla, xla-grouped, xla-onehot"
    with pytest.raises(ValueError, match=f"unknown kernel backend 'cuda'; {listed}"):
        kernels.resolve_backend("cuda")
    with pytest.raises(ValueError, match="'auto' depends on the machine"):
        kernels.get_backend("auto")


def test_cpu_backend_refuses_pools_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="the cpu backend takes float32, bfloat16 pools, got float16"):
        CpuBackend().init_pools(SLOT_SHAPES, 1, S, jnp.float16)


def test_bf16_products_take_default_precision_whatever_the_process_asks() -> None:
    """``operand_precision``: 16-bit operands multiply at ``DEFAULT`` (exact in one MXU pass; Mosaic refuses a
    float32 contract precision on them), anything wider defers to ``jax.default_matmul_precision`` (None)."""
    from loraserve.kernels.shapes import operand_precision

    bf16, f32 = jnp.zeros((2, 2), jnp.bfloat16), jnp.zeros((2, 2), jnp.float32)
    assert operand_precision(bf16, bf16) == jax.lax.Precision.DEFAULT
    assert operand_precision(f32, f32) is None and operand_precision(bf16, f32) is None
    with jax.default_matmul_precision("highest"):  # a bf16 product still lowers at DEFAULT
        text = (
            jax.jit(lambda a, b: jnp.dot(a, b, precision=operand_precision(a, b))).lower(bf16, bf16).as_text()
        )
    assert "HIGHEST" not in text
