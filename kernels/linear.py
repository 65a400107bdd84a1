"""``linear``: the weights-first matmul shared by the model's projections and the ``xla-grouped`` prefill,
and ``argmax_last``, the greedy pick over its logits that reads them in the layout ``linear`` made.

Hugging Face stores a projection as ``w [out, in]``; the product is ``x @ w.T``. For few rows XLA:CPU
runs it faster as ``w @ x.T`` (the narrow side of the GEMM in the kernel's favoured place), so below
:data:`WEIGHTS_FIRST_MAX_ROWS` rows on a CPU it is written that way, behind an optimisation barrier.

A bf16 model's decode step is a few rows against every weight, and XLA:CPU streams bf16 weights at a
fraction of what DRAM gives (1.6 GB/s at one row, 11-13 GB/s at 4-16 on the bench model): there, up to
:func:`kernel_max_rows` rows (24; 64 on AMX tiles), the product is the C++ kernel ``kernels.cpu.linear_bf16``
(prefetched weights, AVX-512 BF16 dot products, AMX tiles where the CPU has them, else bf16 widened to f32
in registers), in the same ``[out, rows]`` layout. Which one runs is the *linear backend*
(:data:`LINEAR_BACKENDS`), chosen while a program is traced (:func:`use_backend`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

# Up to this many rows, XLA:CPU multiplies faster as ``w [out, in] @ x.T`` than as ``x @ w.T`` (the
# narrow side of the GEMM in the kernel's favoured place): 3.2 vs 6.1 ms for one bench-model layer at
# 16 rows, 9.1 vs 12.3 ms for its lm_head; at 64 rows it is still even or a little ahead, at 256 behind.
WEIGHTS_FIRST_MAX_ROWS = 64

# Up to this many rows a bf16 product runs in the C++ kernel where the backend allows. The bench model's
# 8 layers and lm_head as a dependent chain (Zen 4, 2 threads, 2026-12-04), XLA vs kernel in ms: 161 vs
# 13.8 at 1 row, 20.2 vs 13.5 at 4, 22.5 vs 17.5 at 8, 19.7 vs 17.5 at 16, 37.2 vs 23.5 at 24; even at 32
# (30.5 vs 30.4), and XLA's GEMM ahead at 64 (the kernel's tiles reuse x less than a real GEMM's).
KERNEL_MAX_ROWS = 24
# On AMX tiles (kernels.cpu.amx) up to 64 rows cost about what one does, and the kernel stays ahead of
# XLA's GEMM (4096 x 4096, 2-core Xeon, 2026-12-06, XLA vs kernel in ms: 2.8 vs 2.2 at 32 rows, 3.7 vs 2.4
# at 48, 4.1 vs 2.6 at 64; even at 24).
AMX_KERNEL_MAX_ROWS = 64
# Without bf16 dot products (AVX2, AVX-512 without BF16) the kernel widens bf16 to f32 in registers and still
# streams the weights many times faster than XLA's dot for few rows (2-core AVX2 Zen 3, 2026-12-07, kernel vs
# XLA in ms, one of 6 weights in turn; 4096 x 4096: 1.51 vs 32.3 at 1 row, 1.94 vs 7.0 at 4, 3.76 vs 8.19 at
# 8, 5.29 vs 6.33 at 12, 6.46 vs 5.97 at 16, 10.5 vs 20.0 at 24; the bench model's 32000 x 1024 head: 3.44 vs
# 52.8 at 1 row, 13.5 vs 11.8 at 16, 19.0 vs 27.1 at 24): the same KERNEL_MAX_ROWS there.

# auto: the kernel wherever it builds, up to kernel_max_rows() rows (with AVX-512 BF16, kernels.cpu.bf16_dot,
# or on AMX tiles: 4096 x 4096 from a set of 8, 2 cores of a Xeon with AMX, 2026-12-06, XLA vs kernel in the
# same process 19-25 vs 1.2-1.8 ms at 1 row, even at 16 (1.5-2.0 each); widening to f32 elsewhere, above);
# cpu: the kernel for every bf16 product of up to kernel_max_rows() rows on the CPU (raises if the kernels do
# not build); xla: XLA's dot only (what sharded programs need: a custom call would make GSPMD gather the
# weights).
LINEAR_BACKENDS = ("auto", "xla", "cpu")

_backend: contextvars.ContextVar[str] = contextvars.ContextVar("loraserve_linear_backend", default="auto")

_CONTRACT_MINOR = (((1,), (1,)), ((), ()))  # [N, K] x [M, K] -> [N, M]


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Trace the products inside with linear backend ``name`` (one of :data:`LINEAR_BACKENDS`). The
    choice is baked into what ``jax.jit`` traces, so it has to be in force while a program is traced, and
    jit keeps one trace per function whatever was in force then: :func:`traced_with` makes a function
    of its own for each choice."""
    check_backend(name)
    token = _backend.set(name)
    try:
        yield
    finally:
        _backend.reset(token)


def current_backend() -> str:
    """The linear backend in force while the current program is traced (:func:`use_backend`)."""
    return _backend.get()


def traced_with(name: str, fn: Callable) -> Callable:
    """``fn`` run under :func:`use_backend` ``(name)``: give this to ``jax.jit`` so every trace of it
    (a new shape compiles later, at first call) uses the same linear backend."""
    check_backend(name)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with use_backend(name):
            return fn(*args, **kwargs)

    return wrapped


def check_backend(name: str) -> None:
    """Raise ``ValueError`` for a linear backend outside :data:`LINEAR_BACKENDS`; for ``cpu``, also
    when the C++ kernels are unusable here (``kernels.cpu.available``)."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be one of {', '.join(LINEAR_BACKENDS)}, got {name!r}")
    if name == "cpu":
        from loraserve.kernels import cpu

        if not cpu.available():
            raise ValueError("linear backend cpu needs the C++ CPU kernels, which do not build or load here")


def resolve_backend(name: str) -> str:
    """What ``name`` runs here, ``cpu`` or ``xla`` (``auto``: ``cpu`` where the kernel wins, see
    :data:`LINEAR_BACKENDS`); for logs and the worker's status."""
    check_backend(name)
    if name == "auto":
        return "cpu" if jax.default_backend() == "cpu" and _auto_kernel() else "xla"
    return name


def linear(x: jax.Array, w: jax.Array) -> jax.Array:  # [..., out] f32
    """x ``[..., in]``, w ``[out, in]`` (Hugging Face layout) -> ``[..., out]`` in f32.

    *Semantics:* ``x @ w.T`` with f32 accumulation.
    """
    lead, rows = x.shape[:-1], x.size // x.shape[-1]
    x2 = x.reshape(rows, x.shape[-1])
    if _use_kernel(x2, w):
        # [out, rows] like the weights-first dot (argmax_last reads it so); a program exported from a CPU
        # for another platform (jax.export(..., platforms=["tpu"])) lowers XLA's dot there
        y = jax.lax.platform_dependent(x2, w, cpu=_kernel, default=_xla_weights_first).T
    elif _weights_first(rows):
        y = _xla_weights_first(x2, w).T
    else:
        y = jax.lax.dot_general(x2, w, _CONTRACT_MINOR, preferred_element_type=jnp.float32)
    return y.reshape(*lead, w.shape[0])


def _xla_weights_first(x2: jax.Array, w: jax.Array) -> jax.Array:  # [out, rows]
    # The barrier keeps XLA from folding the transpose back into the dot (which undoes the gain).
    yt = jax.lax.dot_general(w, x2, _CONTRACT_MINOR, preferred_element_type=jnp.float32)
    return jax.lax.optimization_barrier(yt)


@jax.custom_batching.custom_vmap
def _kernel(x2: jax.Array, w: jax.Array) -> jax.Array:  # [out, rows] f32
    from loraserve.kernels import cpu

    return cpu.linear_bf16(x2, w)


@_kernel.def_vmap
def _kernel_vmap(axis_size: int, in_batched: list[bool], x2: jax.Array, w: jax.Array):
    """Under ``jax.vmap`` (``add_segments``' map over packed prompts): one call over every example's
    rows when the weights are shared (XLA's dot past :func:`kernel_max_rows` rows), one call per
    example when each has its own."""
    x_batched, w_batched = in_batched
    if w_batched:
        xs = x2 if x_batched else jnp.broadcast_to(x2, (axis_size, *x2.shape))
        return jax.lax.map(lambda xw: _kernel(*xw), (xs, w)), True
    flat = x2.reshape(-1, x2.shape[-1])
    y = _kernel(flat, w) if flat.shape[0] <= kernel_max_rows() else _xla_weights_first(flat, w)
    return jnp.moveaxis(y.reshape(w.shape[0], axis_size, x2.shape[-2]), 1, 0), True


def kernel_max_rows() -> int:
    """Rows up to which a bf16 product may take the kernel here: :data:`AMX_KERNEL_MAX_ROWS` where it runs on
    AMX tiles, else :data:`KERNEL_MAX_ROWS`."""
    from loraserve.kernels import cpu

    return AMX_KERNEL_MAX_ROWS if jax.default_backend() == "cpu" and cpu.amx() else KERNEL_MAX_ROWS


def _weights_first(rows: int) -> bool:
    return rows <= WEIGHTS_FIRST_MAX_ROWS and jax.default_backend() == "cpu"


def _use_kernel(x2: jax.Array, w: jax.Array) -> bool:
    name = _backend.get()
    if name == "xla" or jax.default_backend() != "cpu" or not 0 < x2.shape[0] <= kernel_max_rows():
        return False
    if x2.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16 or w.ndim != 2 or _sharded(w) or _sharded(x2):
        return False
    return name == "cpu" or _auto_kernel()


def _sharded(a: jax.Array) -> bool:
    """True when ``a``'s abstract value lies on a mesh of several devices (a tensor-parallel program that
    committed its arrays to a mesh); GSPMD would gather a custom call's operands onto every device."""
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    return mesh is not None and mesh.size > 1


def _auto_kernel() -> bool:
    from loraserve.kernels import cpu

    return cpu.available()  # cached there


def argmax_last(y: jax.Array) -> jax.Array:  # [rows] int32
    """``jnp.argmax(y, axis=-1)`` (the first of equal maxima) of ``y [rows, out]``, a :func:`linear`
    output or elementwise of one (logits). Weights-first, ``y`` lies as ``[out, rows]``: the reductions
    run over that axis of it (bench model's lm_head at 64 rows, bf16: matmul + argmax 12.6 -> 5.2 ms; XLA
    fused the transpose into a strided argmax). A row of NaNs, which has no maximum, gives ``out - 1``."""
    if not _weights_first(y.shape[0]):
        return jnp.argmax(y, axis=-1).astype(jnp.int32)
    yt = y.T  # [out, rows]: transposing linear's transpose back, which XLA folds away
    ids = jnp.arange(yt.shape[0], dtype=jnp.int32)[:, None]
    return jnp.min(jnp.where(yt == yt.max(axis=0, keepdims=True), ids, yt.shape[0] - 1), axis=0)
