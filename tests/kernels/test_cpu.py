"""The ``cpu`` backend (C++ through XLA's FFI) equals the ``reference`` backend.

Tolerances as in test_xla.py (kernels.testing.TOLERANCE): f32 2e-5, bf16 2e-2; rows whose idx is
outside [0, S) come back as y bit for bit (shrink: exactly 0). The second property test uses shapes
large enough for every vector path of the kernel (8/32/64-column blocks, 1/2/4-row blocks, k-split
partial sums, column splits across threads when one slot holds many rows) plus their scalar tails.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve import kernels
from loraserve.kernels import cpu
from loraserve.kernels import reference as ref
from tests.kernels.strategies import Problem, assert_matches_reference, problems, run_all_ops
from tests.platform import cpp_only

pytestmark = cpp_only

FAST = settings(max_examples=15, deadline=None)


def test_the_kernels_build_here() -> None:
    """CI's machines have a C++ compiler: the backend must be available, not silently skipped."""
    cpu.ensure_registered()
    assert cpu.available()
    assert any(p.name.startswith("lora_cpu-") for p in cpu.cache_dir().iterdir())


@FAST
@given(problems())
def test_cpu_matches_reference(p: Problem) -> None:
    assert_matches_reference(p, run_all_ops(p, "cpu"), run_all_ops(p, "reference"))


@jax.jit
def _both(y, x, A, Bs, idx):
    h = ref.lora_shrink(x, A, idx, out_dtype=jnp.float32)
    return {
        "add": (cpu.add_lora_slices(y, x, A, Bs, idx), ref.add_lora_slices(y, x, A, Bs, idx)),
        "shrink": (cpu.lora_shrink(x, A, idx, out_dtype=jnp.float32), h),
        "expand": (cpu.lora_expand_slices(h, Bs, idx, y), ref.lora_expand_slices(h, Bs, idx, y)),
    }


@settings(max_examples=20, deadline=None)
@given(
    T=st.integers(1, 70),
    S=st.integers(1, 20),
    d_in=st.integers(1, 300),
    outs=st.lists(st.integers(1, 700), min_size=1, max_size=3),
    R=st.sampled_from([1, 3, 4, 8, 16, 20]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    mix=st.sampled_from(["distinct", "one", "few", "random"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_cpu_matches_reference_at_model_sizes(T, S, d_in, outs, R, dtype, mix, seed) -> None:
    rng = np.random.default_rng(seed)
    n = len(outs)
    idx = {
        "distinct": np.arange(T) % S,
        "one": np.full(T, S - 1),
        "few": rng.integers(0, min(S, 3), T),
        "random": rng.integers(-1, S + 2, T),  # includes -1 and out-of-range ids: no adapter
    }[mix]
    x = jnp.asarray(rng.standard_normal((T, d_in)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((T, sum(outs))), jnp.float32)
    A = jnp.asarray(rng.standard_normal((S, d_in, n * R)) / np.sqrt(d_in), dtype)
    Bs = tuple(jnp.asarray(rng.standard_normal((S, R, o)) / np.sqrt(R), dtype) for o in outs)
    got = _both(y, x, A, Bs, jnp.asarray(idx, jnp.int32))
    for name, (mine, want) in got.items():
        np.testing.assert_allclose(np.asarray(mine), np.asarray(want), atol=2e-5 * 4, rtol=2e-5, err_msg=name)
    none = (idx < 0) | (idx >= S)
    np.testing.assert_array_equal(np.asarray(got["add"][0])[none], np.asarray(y)[none])
    np.testing.assert_array_equal(np.asarray(got["shrink"][0])[none], 0.0)


def test_bf16_pools_hold_bf16_values_exactly() -> None:
    """bf16 pools are widened exactly: the kernel equals f32 math on the same (rounded) values."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 1024)), jnp.float32)
    y = jnp.zeros((16, 1536), jnp.float32)
    A = jnp.asarray(rng.standard_normal((16, 1024, 48)) / 32, jnp.bfloat16)
    Bs = tuple(jnp.asarray(rng.standard_normal((16, 16, o)) / 4, jnp.bfloat16) for o in (1024, 256, 256))
    idx = jnp.arange(16, dtype=jnp.int32)
    got = jax.jit(cpu.add_lora_slices)(y, x, A, Bs, idx)
    want = ref.add_lora_slices(y, x, A.astype(jnp.float32), tuple(B.astype(jnp.float32) for B in Bs), idx)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(want).max()) > 1.0  # not a vacuous comparison of zeros


def test_through_the_public_api_and_sgmv() -> None:
    """backend="cpu" dispatches here, and the SGMV prefill ops run through the per-token kernel."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((10, 24)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((10, 40)), jnp.float32)
    A = jnp.asarray(rng.standard_normal((3, 24, 8)), jnp.float32)
    B = jnp.asarray(rng.standard_normal((3, 8, 40)), jnp.float32)
    seg = (jnp.array([2, -1, 0], jnp.int32), jnp.array([4, 3, 2], jnp.int32))
    got = kernels.add_lora_sgmv(y, x, A, B, *seg, backend="cpu")
    want = kernels.add_lora_sgmv(y, x, A, B, *seg, backend="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-5)


def test_bad_pool_dtype_is_a_clear_error() -> None:
    x, y = jnp.zeros((2, 4)), jnp.zeros((2, 6))
    A, B = jnp.zeros((1, 4, 2), jnp.float16), jnp.zeros((1, 2, 6), jnp.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16 pools"):
        kernels.add_lora(y, x, A, B, jnp.zeros(2, jnp.int32), backend="cpu")
    with pytest.raises(ValueError, match="share one dtype"):
        kernels.add_lora(
            y, x, A.astype(jnp.float32), B.astype(jnp.bfloat16), jnp.zeros(2, jnp.int32), backend="cpu"
        )


def test_without_a_compiler_the_backend_reports_unavailable(tmp_path) -> None:
    """No compiler and an empty cache: available() is False and the error says why (fresh process)."""
    code = (
        "import kernels.cpu as c, sys\n"
        "print(c.available())\n"
        "try:\n    c.ensure_registered()\nexcept c.CpuKernelUnavailable as e:\n    print('ERR', e)\n"
    )
    env = {
        "PATH": str(tmp_path),
        "CXX": "",
        "LORASERVE_KERNEL_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    lines = out.stdout.splitlines()
    assert lines[0] == "False"
    assert lines[1].startswith("ERR no C++ compiler found")
    # ... but a cached build is used without any compiler (an image built with one, run without)
    cpu.ensure_registered()
    env["LORASERVE_KERNEL_CACHE_DIR"] = str(cpu.cache_dir())
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.splitlines() == ["True"]
