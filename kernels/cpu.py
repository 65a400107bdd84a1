"""The ``cpu`` backend: grouped multi-LoRA as XLA FFI custom calls (``kernels/csrc/lora.cc``).

On XLA:CPU the best pure-XLA form of a mixed-adapter batch still pays for its grouping in glue
(``kernels.grouped``: masks, gathers, a loop over heavy slots), and XLA:CPU runs bfloat16 matmuls
far slower than float32 ones. This backend is one C++ call per fused projection: rows are grouped
by slot inside the call, each slot's matrices are read once for all of its rows, and pools may be
float32 or bfloat16 (widened in registers, so bf16 pools halve the bytes a decode step streams —
which is what bounds many distinct adapters on a CPU). Math is float32.

The sources (``kernels/csrc``: one per kernel family, ``lora.cc``, ``attention.cc``, ``linear.cc``, and the
shared ``common.h``) are compiled into one library on first use with the system C++ compiler (``$CXX``, else ``c++``/``g++``),
``-O3 -march=native`` (``$LORASERVE_KERNEL_MARCH`` names another target, e.g. ``x86-64-v3`` for an
image that runs on other CPUs than the one it was built on), into ``$LORASERVE_KERNEL_CACHE_DIR``
(default ``~/.cache/loraserve/kernels``), keyed by the sources, jaxlib's version, this CPU's feature
flags and the compiler flags; later processes load the cached library. :func:`available` says whether that works here; without a compiler the worker's ``auto``
backend falls back to ``xla``.

Layout and semantics are docs/design.md §6's, like ``reference``: ``x [T, in]``, ``A [S, in, R]``,
``B [S, R, out]``, ``idx [T]`` (−1 = no adapter). CPU only: it does not lower for TPU or GPU.

The same library holds the decode attention over the paged cache (:func:`paged_attention`, ``attention.cc``)
and the base model's projections for a few rows (``linear.cc``): bf16 (:func:`linear_bf16`, which ``kernels.linear``
calls) and weight-only int8 / group-wise int4 (:func:`linear_int8`, :func:`linear_int4`, which ``models.quantization`` calls).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.kernels.shapes import ACC_DTYPE, check_expand, check_shrink, check_slices, valid_rows

CSRC = Path(__file__).with_name("csrc")
# one library from one source per kernel family, and the header they share
SOURCES = (CSRC / "lora.cc", CSRC / "attention.cc", CSRC / "linear.cc")
HEADERS = (CSRC / "common.h", CSRC / "amx.h")
TARGETS = {
    "loraserve_lora_delta": "LoraDelta",
    "loraserve_lora_shrink": "LoraShrink",
    "loraserve_lora_expand": "LoraExpand",
    "loraserve_paged_attention": "PagedAttention",
    "loraserve_linear_bf16": "LinearBf16",
    "loraserve_linear_int8": "LinearInt8",
    "loraserve_linear_int4": "LinearInt4",
}
POOL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


class CpuKernelUnavailable(RuntimeError):
    """The C++ kernels cannot be built or loaded here (no compiler, no jaxlib headers, ...)."""


def _compiler() -> str:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise CpuKernelUnavailable("no C++ compiler found (set CXX, or install g++)")


def _cpu_flags() -> str:
    """This CPU's feature flags: part of the cache key, since the library is built for -march=native."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    root = os.environ.get("LORASERVE_KERNEL_CACHE_DIR") or Path.home() / ".cache" / "loraserve" / "kernels"
    return Path(root)


def _build() -> Path:
    """Compile the kernels (or reuse the cached build); returns the shared library's path."""
    import jaxlib

    source = b"\0".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    march = os.environ.get("LORASERVE_KERNEL_MARCH") or "native"
    # no floating-point contraction: GCC fused a * b + c into one FMA in some template instantiations
    # and not in others, so a row's bits depended on how many rows shared its slot (batch invariance,
    # tests/kernels/test_row_isolation.py); every product and sum is now rounded the same way everywhere
    flags = ["-O3", f"-march={march}", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC"]
    key = hashlib.sha256(
        b"\0".join([source, jaxlib.__version__.encode(), _cpu_flags().encode(), *map(str.encode, flags)])
    ).hexdigest()[:24]
    lib = cache_dir() / f"lora_cpu-{key}.so"
    if lib.exists():  # a cached build needs no compiler (e.g. an image built with one, run without)
        return lib
    cxx = _compiler()
    lib.parent.mkdir(parents=True, exist_ok=True)
    include = jax.ffi.include_dir()
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [cxx, *flags, "-I", include, *map(str, SOURCES), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise CpuKernelUnavailable(
                f"compiling {', '.join(p.name for p in SOURCES)} failed:\n{' '.join(cmd)}\n{proc.stderr[-4000:]}"
            )
        os.replace(out, lib)  # atomic: concurrent builders each publish a complete file
    return lib


@functools.cache
def _register() -> ctypes.CDLL:
    lib = ctypes.cdll.LoadLibrary(str(_build()))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


def ensure_registered() -> None:
    """Build (first time), load and register the FFI targets; raises :class:`CpuKernelUnavailable`."""
    try:
        _register()
    except CpuKernelUnavailable:
        raise
    except Exception as exc:  # a broken toolchain or library: report it the same way
        raise CpuKernelUnavailable(f"loading the CPU LoRA kernels failed: {exc}") from exc


@functools.cache
def available() -> bool:
    """True when the kernels build and load here and JAX runs on the CPU."""
    if jax.default_backend() != "cpu":
        return False
    try:
        ensure_registered()
    except CpuKernelUnavailable:
        return False
    return True


@functools.cache
def bf16_dot() -> bool:
    """True when the built library multiplies bf16 with AVX-512 BF16 dot products (``vdpbf16ps``), where
    :func:`linear_bf16` is fastest; without them it widens bf16 to f32 in registers, still well ahead of
    XLA:CPU's bf16 dot for a few rows (``kernels.linear``). False where the kernels are unavailable."""
    return available() and bool(_register().LoraserveLinearBf16Dot())


@functools.cache
def amx() -> bool:
    """True when the projections' kernels (:func:`linear_bf16`, and :func:`linear_int8` for bf16 x) multiply on
    AMX tiles (``kernels/csrc/amx.h``): the build has them (``-march=native`` on such a CPU), Linux granted the
    process their state, and ``LORASERVE_KERNEL_AMX`` is not ``0``. Up to 64 rows then cost about what one does."""
    return available() and bool(_register().LoraserveCpuAmx())


@functools.cache
def quant_register_rows() -> int:
    """Where :func:`linear_int8` (and :func:`linear_int4`, for groups of a multiple of 32) multiply bf16 ``x`` on
    AMX tiles: the row count up to which they keep the weights in registers instead (faster at a row or two); a
    row's bits then agree among batches of up to this many rows and among larger ones, not across the two. 0
    where the tiles are not used (one path for every batch)."""
    return int(_register().LoraserveQuantRegisterRows()) if available() else 0


@functools.cache
def quant_fixed_rows(K: int) -> int:
    """Where :func:`linear_int8` multiplies bf16 ``x`` on AMX-INT8 tiles with ``x`` as exact 24-bit fixed point
    (``kernels/csrc/amx.h``): the most rows a call with ``K`` inputs takes that way (10; 0 unless K is a positive
    multiple of 64 up to 65 536). Those calls read each int8 weight once and convert none; their results are
    exact integer sums scaled once, so a row's bits agree among all batches of up to this many rows (the
    register rows above do not apply there), and among larger ones. 0 where the build or CPU lacks AMX-INT8 or
    ``LORASERVE_KERNEL_AMX_INT8=0``."""
    return int(_register().LoraserveQuantFixedRows(ctypes.c_int64(K))) if available() else 0


def _prepare(pool_dtype) -> None:
    if jnp.dtype(pool_dtype) not in POOL_DTYPES:
        raise ValueError(f"the cpu backend takes float32 or bfloat16 pools, got {jnp.dtype(pool_dtype)}")
    ensure_registered()


def _f32(a):
    return a if a.dtype == ACC_DTYPE else a.astype(ACC_DTYPE)


def lora_shrink(x, A, idx, *, out_dtype=None):  # [T, R]
    check_shrink(x, A, idx)
    _prepare(A.dtype)
    call = jax.ffi.ffi_call(
        "loraserve_lora_shrink", jax.ShapeDtypeStruct((x.shape[0], A.shape[2]), ACC_DTYPE)
    )
    return call(_f32(x), idx.astype(jnp.int32), A).astype(out_dtype or x.dtype)


def _plus_delta(y, delta, idx, num_slots: int):
    """``y + delta`` on the rows with an adapter, ``y`` bit for bit on the others (delta is f32)."""
    out = (y.astype(ACC_DTYPE) + delta).astype(y.dtype)
    return jnp.where(valid_rows(idx, num_slots)[:, None], out, y)


def lora_expand_slices(h, Bs: Sequence, idx, y):  # [T, sum(out_i)]
    check_slices(h, Bs, idx, y)
    _prepare(Bs[0].dtype)
    if len({B.dtype for B in Bs}) != 1:
        raise ValueError(f"all B pools must share one dtype, got {[str(B.dtype) for B in Bs]}")
    call = jax.ffi.ffi_call("loraserve_lora_expand", jax.ShapeDtypeStruct(y.shape, ACC_DTYPE))
    return _plus_delta(y, call(_f32(h), idx.astype(jnp.int32), *Bs), idx, Bs[0].shape[0])


def lora_expand(h, B, idx, y):  # [T, out]
    check_expand(h, B, idx, y)
    return lora_expand_slices(h, (B,), idx, y)


def add_lora_slices(y, x, A_cat, Bs: Sequence, idx):  # [T, sum(out_i)]
    """The delta does not depend on y, so XLA may run the call while y's matmul still runs."""
    T, _, S, nR = check_shrink(x, A_cat, idx)
    check_slices(jax.ShapeDtypeStruct((T, nR), ACC_DTYPE), Bs, idx, y)
    _prepare(A_cat.dtype)
    if any(B.dtype != A_cat.dtype for B in Bs):
        raise ValueError("A and B pools must share one dtype")
    call = jax.ffi.ffi_call("loraserve_lora_delta", jax.ShapeDtypeStruct(y.shape, ACC_DTYPE))
    return _plus_delta(y, call(_f32(x), idx.astype(jnp.int32), A_cat, *Bs), idx, S)


def add_lora(y, x, A, B, idx):  # [T, out]
    return add_lora_slices(y, x, A, (B,), idx)


def paged_attention(q, k_pages, v_pages, positions, page_tables, *, scale, softcap, window):  # [B, H, D]
    """Decode attention reading each row's pages in place (``kernels.attention``'s ``"cpu"`` impl; the
    semantics of its ``"xla"`` one, bf16 pages as bf16 or as their uint16 bits). Result in q's dtype."""
    ensure_registered()
    call = jax.ffi.ffi_call("loraserve_paged_attention", jax.ShapeDtypeStruct(q.shape, ACC_DTYPE))
    out = call(
        _f32(q), k_pages, v_pages, positions.astype(jnp.int32), page_tables.astype(jnp.int32),
        scale=np.float32(scale), softcap=np.float32(softcap or 0.0), window=np.int64(window or 0),
    )  # fmt: skip
    return out.astype(q.dtype)


def linear_bf16(x, w):  # [N, M] f32
    """``w [N, K] @ x [M, K].T`` in f32 for bf16 ``x`` and ``w`` (weights first, as ``kernels.linear``
    lays a few rows' product out): the weights streamed with prefetching, AVX-512 BF16 dot products where
    the CPU has them."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear_bf16: x [M, K] and w [N, K], got {x.shape} and {w.shape}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"linear_bf16: bfloat16 x and w, got {x.dtype} and {w.dtype}")
    ensure_registered()
    out = jax.ShapeDtypeStruct((w.shape[0], x.shape[0]), ACC_DTYPE)
    return jax.ffi.ffi_call("loraserve_linear_bf16", out)(x, w)


def linear_int8(x, w, scale):  # [N, M] f32
    """``(w [N, K] int8 @ x [M, K].T) * scale[:, None]`` in f32 for f32 or bf16 ``x`` (weights first, as
    :func:`linear_bf16`): a weight-only int8 base's few-row projection (``models.quantization``), the weights
    streamed at a byte an element and widened in registers."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or scale.shape != (w.shape[0],):
        raise ValueError(
            f"linear_int8: x [M, K], w [N, K], scale [N]; got {x.shape}, {w.shape}, {scale.shape}"
        )
    if x.dtype not in POOL_DTYPES or w.dtype != jnp.int8 or scale.dtype != jnp.float32:
        raise ValueError(
            f"linear_int8: f32|bf16 x, int8 w, f32 scale; got {x.dtype}, {w.dtype}, {scale.dtype}"
        )
    ensure_registered()
    out = jax.ShapeDtypeStruct((w.shape[0], x.shape[0]), ACC_DTYPE)
    return jax.ffi.ffi_call("loraserve_linear_int8", out)(x, w, scale)


def linear_int4(x, w, scale):  # [N, M] f32
    """Group-wise int4 ``w`` times ``x [M, K]`` (f32 or bf16) in f32, weights first as :func:`linear_int8`:
    ``y[n, m] = sum_g scale[n, g] * (q[n, group g] . x[m, group g])`` for ``w`` uint8 ``[N, K/2]`` (element
    ``2j`` of a row in byte ``j``'s low nibble, ``2j + 1`` in its high nibble, each stored as ``q + 8``) and
    ``scale`` f32 ``[N, K/G]`` (G = K / scale.shape[1], even): ``models.quantization``'s int4 layout, the weights
    streamed at half a byte an element and unpacked in registers."""
    ok = x.ndim == w.ndim == scale.ndim == 2
    if ok:
        (_, K), (N, half), (n, groups) = x.shape, w.shape, scale.shape
        # K == 0 has no groups; else G = K / groups, even
        ok = 2 * half == K and n == N and (K % groups == 0 and K // groups % 2 == 0 if groups else K == 0)
    if not ok:
        raise ValueError(
            f"linear_int4: x [M, K], w [N, K/2], scale [N, K/G] (G even); got {x.shape}, {w.shape}, {scale.shape}"
        )
    if x.dtype not in POOL_DTYPES or w.dtype != jnp.uint8 or scale.dtype != jnp.float32:
        raise ValueError(
            f"linear_int4: f32|bf16 x, uint8 w, f32 scale; got {x.dtype}, {w.dtype}, {scale.dtype}"
        )
    ensure_registered()
    out = jax.ShapeDtypeStruct((w.shape[0], x.shape[0]), ACC_DTYPE)
    return jax.ffi.ffi_call("loraserve_linear_int4", out)(x, w, scale)
