"""The quantized few-row kernels (``kernels.cpu.linear_int8`` / ``linear_int4``) against float64.

Both are weight-only: x stays f32 (or bf16, compared on its bf16 values), the weights are exact small integers
times f32 scales, and the kernels sum f32 products in f32 (16- or 8-lane partial sums, per int4 group), so
against a float64 product of the same values the error stays far below ``2e-5 * max|y|`` (seen: ~5e-7). With
bf16 x on a CPU with AVX-512 BF16 the native build converts the weights to bf16 (exact) and multiplies with
bf16 dot products, each product exact in f32: the same bound holds (seen: ~2e-7). Shapes reach every path:
4-row weight blocks (2-row for int4 with bf16 dot products) and their 1-row tail, the 256-row work items split
over threads, 4-column tiles of x rows and their tails (M = 1, 3, 5, 16: one tile, whose int8 weights are
converted in registers, or several, sharing them converted once), the masked tail of K (int8: K % 64, K % 16,
K % 8) and of an int4 group (G / 2 bytes not a multiple of 32, 16 or 8), int4 groups of 4-32 elements packed
several to a step, and on AMX tiles int4 groups of one 16- or 32-byte chunk. A row's result is the same bits
whatever the batch around it (bf16 x on AMX tiles, int8 and int4 in groups of a multiple of 32: in every batch
of up to ``cpu.quant_register_rows()`` rows, and in every larger one). The native build runs here; the AVX2
build (``x86-64-v3``) in one child process.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.kernels import cpu
from tests.platform import CPP_KERNELS, ON_TPU, cpp_only

pytestmark = [
    cpp_only,
    pytest.mark.skipif(
        not ON_TPU and not cpu.available(), reason="C++ kernels unavailable (test_cpu fails then)"
    ),
]

ROWS = (1, 2, 3, 5, 16, 17, 40)  # 17, 40: two and three 16-row groups of x on AMX tiles
INT8_SHAPES = [(517, 1024), (517, 1027), (8, 64), (3, 9)]  # (N, K)
# (N, K, G): G = 128 and the tiny models' 32 / 16; G = 40 and 2 leave a masked tail in every group
# (40, 96, 32), (33, 192, 64): on AMX tiles, groups of one 16-byte chunk and of one 32-byte chunk, 16-row
# blocks and their rest
INT4_SHAPES = [
    (517, 1024, 128),
    (8, 64, 32),
    (3, 16, 16),
    (7, 200, 40),
    (9, 40, 2),
    (40, 96, 32),
    (33, 192, 64),
]
DTYPES = ("float32", "bfloat16")


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Signed values in [-8, 7] ``[N, K]`` -> uint8 ``[N, K/2]``: element 2j in byte j's low nibble, 2j + 1 in
    its high nibble, each stored as q + 8."""
    u = (q.astype(np.int16) + 8).astype(np.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _x(rng, K: int, dtype: str):
    return jnp.asarray(rng.standard_normal((max(ROWS), K)), jnp.float32).astype(dtype)


def _compare(fn, x, weights: tuple, want_all: np.ndarray, split: int = 0) -> float:
    """``fn`` on the first M rows of x for each M in ROWS against ``want_all`` [N, max(ROWS)]; a row's bits are
    the same in every batch (row 0 in each, the last row of the largest alone) or, given ``split``
    (``int8_split``), in every batch of up to ``split`` rows and in every larger one (the last row of the largest
    in a batch of ``split + 1``). Returns the worst error / max|y|."""
    worst, first = 0.0, {}
    for m in ROWS:
        got = np.asarray(jax.jit(fn)(x[:m], *weights))
        want = want_all[:, :m]
        assert got.shape == want.shape and got.dtype == np.float32
        err = float(np.abs(got - want).max() / np.abs(want).max())
        assert err < 2e-5, (m, err)
        worst = max(worst, err)
        first[m] = got[:, 0]
    for m in ROWS:
        np.testing.assert_array_equal(first[m], first[1 if m <= split else min(r for r in ROWS if r > split)])
    last = max(ROWS) - 1
    alone = np.asarray(jax.jit(fn)(x[last - split :], *weights))[:, -1]
    np.testing.assert_array_equal(alone, got[:, last])
    return worst


def check_int8(N: int, K: int, dtype: str, seed: int = 0, qmin: int = -127) -> float:
    rng = np.random.default_rng(seed)
    q = rng.integers(qmin, 128, (N, K)).astype(np.int8)
    scale = rng.uniform(0.5, 2.0, N).astype(np.float32) / 127
    x = _x(rng, K, dtype)
    w64 = q.astype(np.float64) * scale[:, None].astype(np.float64)
    want = w64 @ np.asarray(x.astype(jnp.float32), np.float64).T
    return _compare(cpu.linear_int8, x, (jnp.asarray(q), jnp.asarray(scale)), want, int8_split(K, dtype))


def int8_split(K: int, dtype: str) -> int:
    """The batch size up to which linear_int8 takes one path (a row's bits agree), then another (see _compare)."""
    if dtype != "bfloat16":
        return 0
    return cpu.quant_fixed_rows(K) or cpu.quant_register_rows()


def check_int4(N: int, K: int, G: int, dtype: str, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, (N, K)).astype(np.int8)
    scale = rng.uniform(0.5, 2.0, (N, K // G)).astype(np.float32) / 7
    x = _x(rng, K, dtype)
    w64 = (q.astype(np.float64).reshape(N, K // G, G) * scale[:, :, None].astype(np.float64)).reshape(N, K)
    want = w64 @ np.asarray(x.astype(jnp.float32), np.float64).T
    split = cpu.quant_register_rows() if dtype == "bfloat16" and G % 32 == 0 else 0
    return _compare(cpu.linear_int4, x, (jnp.asarray(pack_int4(q)), jnp.asarray(scale)), want, split)


def check_all() -> float:
    errs = [check_int8(N, K, d) for N, K in INT8_SHAPES for d in DTYPES]
    return max(errs + [check_int4(N, K, G, d) for N, K, G in INT4_SHAPES for d in DTYPES])


def test_pack_int4_layout() -> None:
    q = np.array([[-8, 7, 0, -1], [1, 2, -7, 3]], np.int8)
    assert pack_int4(q).tolist() == [[0xF0, 0x78], [0xA9, 0xB1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("N", "K"), INT8_SHAPES)
def test_linear_int8_matches_float64(N: int, K: int, dtype: str) -> None:
    check_int8(N, K, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_int8_every_value(dtype: str) -> None:
    """All 256 int8 values, -128 too (models.quantization never writes it; the bf16 conversion sets it apart)."""
    assert check_int8(64, 4096, dtype, seed=1, qmin=-128) < 2e-5
    rng = np.random.default_rng(2)
    q = rng.integers(-128, 128, (256, 200)).astype(np.int8)
    q[:, :5] = np.stack([rng.permutation(256) - 128 for _ in range(5)], 1)  # each column every value
    x = jnp.eye(200, dtype=dtype)[:5]  # row m picks column m: y = q[:, :5] exactly
    got = np.asarray(jax.jit(cpu.linear_int8)(x, jnp.asarray(q), jnp.ones(256, jnp.float32)))
    np.testing.assert_array_equal(got, q[:, :5].astype(np.float32))


needs_fixed = pytest.mark.skipif(
    not cpu.quant_fixed_rows(4096),
    reason="no AMX-INT8 tiles in use here: linear_int8 has no fixed-point path",
)


def test_the_fixed_point_path_is_on_exactly_where_the_cpu_has_it() -> None:
    """The fixed-point tests below skip where there is no such path: here, that it is there on every CPU with
    AMX-INT8 tiles in use (a native build, not switched off), so the skips cannot hide a path gone missing,
    and that it takes only the shapes it can (K a positive multiple of 64 up to 65 536)."""
    flags = cpu._cpu_flags().split()
    native = os.environ.get("LORASERVE_KERNEL_MARCH", "native") == "native"
    switched_off = os.environ.get("LORASERVE_KERNEL_AMX_INT8", "").startswith("0")
    expected = 10 if "amx_int8" in flags and cpu.amx() and native and not switched_off else 0
    assert [cpu.quant_fixed_rows(K) for K in (64, 4096, 65536)] == [expected] * 3
    assert [cpu.quant_fixed_rows(K) for K in (0, 63, 100, 65600)] == [0] * 4


def fixed_point_product(q: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """What the fixed-point path defines, exactly: each row of bf16 x rounded (half to even) to multiples of
    2^-s, s = 22 - floor(log2 max|x|), the integer products summed exactly, times scale in double, times 2^-s,
    rounded to f32. ``[N, M]``; x f32 (bf16 values)."""
    out = np.empty((q.shape[0], x.shape[0]), np.float32)
    for m, row in enumerate(x.astype(np.float64)):
        top = np.abs(row).max()
        s = 0 if top == 0 else 22 - int(np.floor(np.log2(top)))
        qx = np.rint(np.ldexp(row, s)).astype(np.int64)
        exact = (q.astype(np.int64) @ qx).astype(np.float64)  # |sum| < 2^53: exact
        out[:, m] = (exact * scale.astype(np.float64) * np.ldexp(1.0, -s)).astype(np.float32)
    return out


@needs_fixed
def test_linear_int8_fixed_point_is_exactly_defined() -> None:
    """On AMX-INT8 tiles a bf16 row's result is an exact integer sum scaled once: the same bits as
    ``fixed_point_product`` for every batch of 1-10 rows, rows whose values span 40 binades (those more than 16
    below the row's largest rounded to its grid), a block of weight rows past the last 16, and -128."""
    rng = np.random.default_rng(3)
    N, K = 70, 4096
    q = rng.integers(-128, 128, (N, K)).astype(np.int8)
    scale = rng.uniform(0.5, 2.0, N).astype(np.float32) / 127
    wide = rng.standard_normal((10, K)) * np.exp2(rng.integers(-30, 10, (10, K)))
    x = jnp.asarray(wide, jnp.float32).astype(jnp.bfloat16)
    x = x.at[3].set(0).at[4, :].set(jnp.bfloat16(-(2.0**-120)))  # a zero row, a row far below 1
    want = fixed_point_product(q, scale, np.asarray(x.astype(jnp.float32)))
    for m in (1, 2, 5, 6, 10):
        got = np.asarray(jax.jit(cpu.linear_int8)(x[:m], jnp.asarray(q), jnp.asarray(scale)))
        np.testing.assert_array_equal(got, want[:, :m])


@needs_fixed
def test_linear_int8_fixed_point_extremes() -> None:
    """The largest K the int32 plane sums allow (65 536) with every weight -128 or 127 and rows at the top of
    their grid (|q| = 2^23 - 2^15, the top plane +-127/-128): exact, no overflow; a row holding inf or NaN gives
    NaN outputs and leaves the other rows' bits as they are."""
    K = 65536
    q = np.full((17, K), -128, np.int8)
    q[1::2] = 127
    v = float(jnp.bfloat16(1.9921875))  # bf16's largest mantissa
    x = jnp.asarray(np.array([[v] * K, [-v] * K, [v, -v] * (K // 2)], np.float32)).astype(jnp.bfloat16)
    got = np.asarray(jax.jit(cpu.linear_int8)(x, jnp.asarray(q), jnp.ones(17, jnp.float32)))
    qs = q[:, 0].astype(np.float64)
    np.testing.assert_array_equal(got, np.stack([qs * v * K, -qs * v * K, 0 * qs], 1).astype(np.float32))
    rng = np.random.default_rng(4)
    q = rng.integers(-127, 128, (48, 256)).astype(np.int8)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    args = (jnp.asarray(q), jnp.ones(48, jnp.float32))
    clean = np.asarray(jax.jit(cpu.linear_int8)(x, *args))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        got = np.asarray(jax.jit(cpu.linear_int8)(x.at[2, 7].set(bad), *args))
        assert np.isnan(got[:, 2]).all()
        np.testing.assert_array_equal(np.delete(got, 2, 1), np.delete(clean, 2, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("N", "K", "G"), INT4_SHAPES)
def test_linear_int4_matches_float64(N: int, K: int, G: int, dtype: str) -> None:
    check_int4(N, K, G, dtype)


def test_empty_shapes() -> None:
    x, q8, s8 = jnp.ones((3, 64)), jnp.ones((5, 64), jnp.int8), jnp.ones(5)
    q4, s4 = jnp.full((5, 32), 0x99, jnp.uint8), jnp.ones((5, 2))  # every q = 1
    assert np.asarray(jax.jit(cpu.linear_int4)(x, q4, s4)).tolist() == [[64.0] * 3] * 5
    for fn, q, s in ((cpu.linear_int8, q8, s8), (cpu.linear_int4, q4, s4)):
        assert jax.jit(fn)(x[:0], q, s).shape == (5, 0)
        assert jax.jit(fn)(x, q[:0], s[:0]).shape == (0, 3)
        assert (
            np.asarray(jax.jit(fn)(x[:, :0], q[:, :0], s[:, :0] if s.ndim == 2 else s)).tolist()
            == [[0.0] * 3] * 5
        )


def test_bad_shapes_and_dtypes_raise() -> None:
    x, q8, s8 = jnp.ones((3, 64)), jnp.ones((5, 64), jnp.int8), jnp.ones(5)
    q4, s4 = jnp.ones((5, 32), jnp.uint8), jnp.ones((5, 2))
    for args in ((x, q8[:, :63], s8), (x, q8, s8[:4]), (x[0], q8, s8), (x, q8, s8[:, None])):
        with pytest.raises(ValueError, match=r"linear_int8: x \[M, K\], w \[N, K\], scale \[N\]"):
            cpu.linear_int8(*args)
    for args in (
        (x.astype(jnp.float16), q8, s8),
        (x, q8.astype(jnp.uint8), s8),
        (x, q8, s8.astype(jnp.bfloat16)),
    ):
        with pytest.raises(ValueError, match=r"linear_int8: f32\|bf16 x, int8 w, f32 scale"):
            cpu.linear_int8(*args)
    # w not K/2 wide, scale rows, groups that do not divide K, an odd group (64 / 64 = 1), 1-D operands
    bad = ((x, q4[:, :31], s4), (x, q4, s4[:4]), (x, q4, jnp.ones((5, 3))), (x, q4, jnp.ones((5, 64))),
           (x[0], q4, s4), (x, q4, s4[:, 0]))  # fmt: skip
    for args in bad:
        with pytest.raises(
            ValueError, match=r"linear_int4: x \[M, K\], w \[N, K/2\], scale \[N, K/G\] \(G even\)"
        ):
            cpu.linear_int4(*args)
    for args in (
        (x.astype(jnp.float16), q4, s4),
        (x, q4.astype(jnp.int8), s4),
        (x, q4, s4.astype(jnp.float16)),
    ):
        with pytest.raises(ValueError, match=r"linear_int4: f32\|bf16 x, uint8 w, f32 scale"):
            cpu.linear_int4(*args)


_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from loraserve.kernels import cpu
from test_linear import SHAPES, _check
from test_linear_quant import check_all
worst_bf16 = max(_check(*s) for s in SHAPES)
out = {{"bf16_dot": cpu.bf16_dot(), "amx": cpu.amx(), "fixed_rows": cpu.quant_fixed_rows(64), "worst": check_all(),
       "worst_bf16": worst_bf16}}
print(json.dumps(out))
"""


@pytest.mark.cpu_only(CPP_KERNELS)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64-v3 is an x86 target")
def test_the_avx2_build(tmp_path: Path) -> None:
    """Every case above, and linear_bf16's (tests/kernels/test_linear.py), through the library built for
    x86-64-v3 (AVX2: the 8-lane paths, bf16 widened to f32), in one child process: one build of the library
    for all three kernels. A host without AVX-512 builds those paths natively: the tests above ran them."""
    if "avx512f" not in cpu._cpu_flags().split():
        pytest.skip("the host's own kernel build is already the AVX2 path")
    env = {**os.environ, "LORASERVE_KERNEL_MARCH": "x86-64-v3", "LORASERVE_KERNEL_CACHE_DIR": str(tmp_path)}
    code = _CHILD.format(tests=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bf16_dot"] is False and out["worst"] < 2e-5 and out["worst_bf16"] < 1e-5
    assert [p.name[:9] for p in tmp_path.iterdir()] == ["lora_cpu-"]


@pytest.mark.cpu_only(CPP_KERNELS)
@pytest.mark.parametrize("switch", ["LORASERVE_KERNEL_AMX", "LORASERVE_KERNEL_AMX_INT8"])
def test_the_other_paths_on_an_amx_cpu(switch: str) -> None:
    """Where the kernels multiply on AMX tiles (kernels/csrc/amx.h), every case above, and linear_bf16's, once
    more with the tiles switched off (``LORASERVE_KERNEL_AMX=0``, read when the library first asks for them):
    the AVX-512 BF16 paths that CPUs without AMX run, from the same build, in one child process; and with only
    int8's fixed-point path off (``LORASERVE_KERNEL_AMX_INT8=0``): 1-2 rows in registers, 3-10 on the bf16 tiles,
    as on AMX CPUs without AMX-INT8."""
    if not cpu.amx():
        pytest.skip("no AMX tiles in use here (none, or Linux refused them): the tests above ran the rest")
    if switch.endswith("INT8") and not cpu.quant_fixed_rows(64):
        pytest.skip("no fixed-point int8 path here: the tests above ran the others")
    env = {**os.environ, switch: "0"}
    code = _CHILD.format(tests=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bf16_dot"] is True and out["amx"] is (switch != "LORASERVE_KERNEL_AMX")
    assert out["fixed_rows"] == 0
    assert out["worst"] < 2e-5 and out["worst_bf16"] < 1e-5
