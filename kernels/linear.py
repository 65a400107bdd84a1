"""``linear``: the weights-first matmul shared by the model's projections and the ``xla-grouped`` prefill,
and ``argmax_last``, the greedy pick over its logits that reads them in the layout ``linear`` made.

Hugging Face stores a projection as ``w [out, in]``; the product is ``x @ w.T``. For few rows XLA:CPU
runs it faster as ``w @ x.T`` (the narrow side of the GEMM in the kernel's favoured place), so below
:data:`WEIGHTS_FIRST_MAX_ROWS` rows on a CPU it is written that way, behind an optimisation barrier.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Up to this many rows, XLA:CPU multiplies faster as ``w [out, in] @ x.T`` than as ``x @ w.T`` (the
# narrow side of the GEMM in the kernel's favoured place): 3.2 vs 6.1 ms for one bench-model layer at
# 16 rows, 9.1 vs 12.3 ms for its lm_head; at 64 rows it is still even or a little ahead, at 256 behind.
WEIGHTS_FIRST_MAX_ROWS = 64

_CONTRACT_MINOR = (((1,), (1,)), ((), ()))  # [N, K] x [M, K] -> [N, M]


def linear(x: jax.Array, w: jax.Array) -> jax.Array:  # [..., out] f32
    """x ``[..., in]``, w ``[out, in]`` (Hugging Face layout) -> ``[..., out]`` in f32.

    *Semantics:* ``x @ w.T`` with f32 accumulation.
    """
    lead, rows = x.shape[:-1], x.size // x.shape[-1]
    x2 = x.reshape(rows, x.shape[-1])
    if _weights_first(rows):
        # The barrier keeps XLA from folding the transpose back into the dot (which undoes the gain).
        yt = jax.lax.dot_general(w, x2, _CONTRACT_MINOR, preferred_element_type=jnp.float32)  # [out, rows]
        y = jax.lax.optimization_barrier(yt).T
    else:
        y = jax.lax.dot_general(x2, w, _CONTRACT_MINOR, preferred_element_type=jnp.float32)
    return y.reshape(*lead, w.shape[0])


def _weights_first(rows: int) -> bool:
    return rows <= WEIGHTS_FIRST_MAX_ROWS and jax.default_backend() == "cpu"


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
