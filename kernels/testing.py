"""Test helpers shared by the kernel and worker tests: counting JAX compilations, random LoRA cases.

``count_compilations()`` listens to JAX's own monitoring events (``jax.monitoring``), which fire
for every jitted function in the process — whichever thread compiles it — and do not depend on a
particular function's private cache:

* ``/jax/core/compile/jaxpr_trace_duration``          — a Python function was (re)traced;
* ``/jax/core/compile/jaxpr_to_mlir_module_duration`` — an executable-cache miss: a new XLA
  module was built (followed by a backend compile or a persistent-cache load);
* ``/jax/core/compile/backend_compile_duration``      — XLA actually compiled it.

``compilations`` counts the middle one, so it is right whether or not the persistent compilation
cache is on. Warm up first (the first call of anything compiles, and so do eager jnp ops the first
time they meet a new shape), then assert that the block compiled nothing::

    f(*args)                         # warm-up
    with count_compilations() as c:
        f(*other_args_same_shapes)
    assert c.compilations == 0, c.names
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import jax.monitoring
import jax.numpy as jnp
import numpy as np

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclass
class CompilationCount:
    """What happened inside a ``count_compilations()`` block (live counters, read them after)."""

    compilations: int = 0  # new XLA modules (executable-cache misses)
    backend_compiles: int = 0  # of which XLA really compiled (not a persistent-cache hit)
    traces: int = 0  # Python functions traced to jaxprs
    names: list[str] = field(default_factory=list)  # fun_name of each compilation, in order

    def __int__(self) -> int:
        return self.compilations


_lock = threading.Lock()


@contextmanager
def count_compilations() -> Iterator[CompilationCount]:
    """Count JAX traces and compilations made by any thread while the block runs."""
    count = CompilationCount()

    def listener(event: str, duration: float, **kwargs) -> None:
        with _lock:
            if event == LOWER_EVENT:
                count.compilations += 1
                count.names.append(str(kwargs.get("fun_name", "?")))
            elif event == BACKEND_COMPILE_EVENT:
                count.backend_compiles += 1
            elif event == TRACE_EVENT:
                count.traces += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# ----------------------------------------------------------------------------------------------
# Random multi-LoRA problems with the layout the worker uses.

# Tolerances (atol = rtol) for comparing a backend with the reference. f32: only the summation
# order differs. bf16: inputs are the same bf16 numbers and products are exact in f32, so results
# differ by at most ~1 bf16 ulp (2^-8 relative) after the final rounding, for values of size ~1.
TOLERANCE = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}


def tolerance(dtype) -> float:
    """atol/rtol for comparing outputs of ``dtype`` across backends (values of order 1)."""
    return TOLERANCE[jnp.dtype(dtype)]


@dataclass(frozen=True)
class LoraCase:
    """One batched multi-LoRA problem; weights scaled so every output is of order 1."""

    x: jax.Array  # [T, in]
    A: jax.Array  # [S, in, R]  (slot s has rank ranks[s] <= R, zero-padded)
    B: jax.Array  # [S, R, out]
    y: jax.Array  # [T, out]
    idx: jax.Array  # [T] int32, -1 = no adapter
    ranks: tuple[int, ...]  # real rank of each slot


def random_lora_case(
    seed: int,
    *,
    T: int,
    d_in: int,
    d_out: int,
    S: int,
    R: int,
    dtype=jnp.float32,
    p_none: float = 0.2,
    max_rank: int | None = None,
) -> LoraCase:
    """Random x, y, slots with ranks in ``[1, max_rank or R]`` zero-padded to R, and idx with −1's.

    *Semantics:* a deterministic function of its arguments (numpy ``default_rng(seed)``).
    """
    rng = np.random.default_rng(seed)
    ranks = rng.integers(1, (max_rank or R) + 1, size=S)
    lane = np.arange(R)
    A = rng.standard_normal((S, d_in, R)) / np.sqrt(d_in) * (lane < ranks[:, None])[:, None, :]
    B = (
        rng.standard_normal((S, R, d_out))
        / np.sqrt(ranks)[:, None, None]
        * (lane < ranks[:, None])[:, :, None]
    )
    idx = rng.integers(0, S, size=T)
    idx[rng.random(T) < p_none] = -1

    def arr(a):  # converted on the host (the same rounding as XLA's): no eager op to compile per shape
        return jnp.asarray(np.asarray(a, np.float32).astype(dtype))

    return LoraCase(
        x=arr(rng.standard_normal((T, d_in))),
        A=arr(A),
        B=arr(B),
        y=arr(rng.standard_normal((T, d_out))),
        idx=jnp.asarray(idx, jnp.int32),
        ranks=tuple(int(r) for r in ranks),
    )
