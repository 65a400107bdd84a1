"""The public multi-LoRA ops: one signature, the implementation picked by ``backend=`` name.

``backend`` is a plain Python string, so it is static under ``jax.jit``; the arrays (including the
slot ids) are traced, so serving a new mix of adapters never recompiles. Backends:

* ``"reference"`` — gather + matmul, exact; the truth in tests.
* ``"xla-onehot"`` — one-hot masked matmuls that XLA fuses; the default here (the same ops as the
  ``xla-onehot`` backend object of :mod:`kernels.backends`; the worker's default XLA backend,
  ``xla-grouped``, decodes with :mod:`kernels.grouped` instead).
* ``"pallas"``    — TPU kernels that skip unused slots (interpreted off-TPU, slow there).
* ``"cpu"``       — C++ kernels called through XLA's FFI (:mod:`kernels.cpu`): rows grouped by slot,
  float32 or bfloat16 pools; CPU only, built with the system compiler on first use.

Shapes: ``x [T, in]``, ``A [S, in, R]``, ``B [S, R, out]``, ``idx [T]`` int (−1 = no adapter),
``y [T, out]``. Results have y's dtype (shrink: x's dtype unless ``out_dtype``); math is f32.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from loraserve.kernels import cpu, pallas, reference, sgmv, xla
from loraserve.kernels.shapes import ACC_DTYPE

# The function-level implementations; the worker picks a backend *object* (kernels.backends) instead.
BACKENDS: tuple[str, ...] = ("reference", "xla-onehot", "pallas", "cpu")

_MODULES: dict[str, ModuleType] = {"reference": reference, "xla-onehot": xla, "pallas": pallas, "cpu": cpu}


def backend_module(backend: str) -> ModuleType:
    """The module implementing ``backend``; ``ValueError`` naming the choices for anything else."""
    try:
        return _MODULES[backend]
    except (KeyError, TypeError):
        raise ValueError(f"unknown kernels backend {backend!r}; expected one of {BACKENDS}") from None


def lora_shrink(x, A, idx, *, backend: str = "xla-onehot", out_dtype=None):  # [T, R]
    """x ``[T, in]``, A ``[S, in, R]``, idx ``[T]`` → ``[T, R]``.

    *Semantics:* ``h[t] = x[t] @ A[idx[t]]``, or 0 where idx[t] is −1 (any value outside ``[0, S)``).
    """
    return backend_module(backend).lora_shrink(x, A, idx, out_dtype=out_dtype)


def lora_expand(h, B, idx, y, *, backend: str = "xla-onehot"):  # [T, out]
    """h ``[T, R]``, B ``[S, R, out]``, idx ``[T]``, y ``[T, out]`` → ``[T, out]`` (y's dtype).

    *Semantics:* ``out[t] = y[t] + h[t] @ B[idx[t]]``; rows with idx −1 return ``y[t]`` unchanged.
    """
    return backend_module(backend).lora_expand(h, B, idx, y)


def lora_expand_slices(h, Bs: Sequence, idx, y, *, backend: str = "xla-onehot"):  # [T, sum(out_i)]
    """h ``[T, n*R]``, Bs n × ``[S, R, out_i]``, idx ``[T]``, y ``[T, sum(out_i)]``.

    *Semantics:* columns ``off_i:off_i+out_i`` of y get ``h[:, i*R:(i+1)*R] @ Bs[i][idx]`` added.
    """
    return backend_module(backend).lora_expand_slices(h, tuple(Bs), idx, y)


def add_lora(y, x, A, B, idx, *, backend: str = "xla-onehot"):  # [T, out]
    """y ``[T, out]``, x ``[T, in]``, A ``[S, in, R]``, B ``[S, R, out]``, idx ``[T]``.

    *Semantics:* ``lora_expand(lora_shrink(x, A, idx), B, idx, y)`` with the rank-R intermediate in f32.
    """
    return backend_module(backend).add_lora(y, x, A, B, idx)


def add_lora_slices(y, x, A_cat, Bs: Sequence, idx, *, backend: str = "xla-onehot"):  # [T, sum(out_i)]
    """y ``[T, sum(out_i)]``, x ``[T, in]``, A_cat ``[S, in, n*R]``, Bs n × ``[S, R, out_i]``, idx ``[T]``.

    *Semantics:* slice i of y gets ``x @ A_cat[idx][:, i*R:(i+1)*R] @ Bs[i][idx]`` added.
    """
    return backend_module(backend).add_lora_slices(y, x, A_cat, tuple(Bs), idx)


# ----------------------------------------------------------------------------------------------
# Prefill (SGMV): contiguous segments of tokens, one slot per segment; see kernels/sgmv.py.
# ``method`` only matters for the xla backend ("masked" or "ragged").


def lora_shrink_sgmv(
    x, A, seg_slots, seg_lens, *, backend: str = "xla-onehot", out_dtype=None, method="masked"
):
    """x ``[T, in]``, A ``[S, in, R]``, seg_slots/seg_lens ``[G]`` → ``[T, R]``.

    *Semantics:* ``h[t] = x[t] @ A[seg_slots[g]]`` for t in segment g; 0 for slot −1 and the tail.
    """
    if backend_module(backend) is xla:
        return sgmv.xla_shrink_sgmv(x, A, seg_slots, seg_lens, out_dtype=out_dtype, method=method)
    idx = sgmv.segments_to_idx(seg_slots, seg_lens, x.shape[0])
    return lora_shrink(x, A, idx, backend=backend, out_dtype=out_dtype)


def lora_expand_sgmv(h, B, seg_slots, seg_lens, y, *, backend: str = "xla-onehot", method="masked"):
    """h ``[T, R]``, B ``[S, R, out]``, seg_slots/seg_lens ``[G]``, y ``[T, out]`` → ``[T, out]``.

    *Semantics:* ``out[t] = y[t] + h[t] @ B[seg_slots[g]]`` for t in segment g; ``y[t]`` otherwise.
    """
    if backend_module(backend) is xla:
        return sgmv.xla_expand_sgmv(h, B, seg_slots, seg_lens, y, method=method)
    idx = sgmv.segments_to_idx(seg_slots, seg_lens, h.shape[0])
    return lora_expand(h, B, idx, y, backend=backend)


def add_lora_sgmv(y, x, A, B, seg_slots, seg_lens, *, backend: str = "xla-onehot", method="masked"):
    """y ``[T, out]``, x ``[T, in]``, A ``[S, in, R]``, B ``[S, R, out]``, seg_slots/seg_lens ``[G]``.

    *Semantics:* ``add_lora`` with ``idx = segments_to_idx(seg_slots, seg_lens, T)``.
    """
    if backend_module(backend) is xla:
        h = sgmv.xla_shrink_sgmv(x, A, seg_slots, seg_lens, out_dtype=ACC_DTYPE, method=method)
        return sgmv.xla_expand_sgmv(h, B, seg_slots, seg_lens, y, method=method)
    return add_lora(y, x, A, B, sgmv.segments_to_idx(seg_slots, seg_lens, x.shape[0]), backend=backend)


def add_lora_slices_sgmv(
    y, x, A_cat, Bs: Sequence, seg_slots, seg_lens, *, backend="xla-onehot", method="masked"
):
    """Fused-projection ``add_lora_sgmv``: A_cat ``[S, in, n*R]``, Bs n × ``[S, R, out_i]``.

    *Semantics:* ``add_lora_slices`` with ``idx = segments_to_idx(seg_slots, seg_lens, T)``.
    """
    if backend_module(backend) is xla:
        h = sgmv.xla_shrink_sgmv(x, A_cat, seg_slots, seg_lens, out_dtype=ACC_DTYPE, method=method)
        return sgmv.xla_expand_slices_sgmv(h, tuple(Bs), seg_slots, seg_lens, y, method=method)
    idx = sgmv.segments_to_idx(seg_slots, seg_lens, x.shape[0])
    return add_lora_slices(y, x, A_cat, Bs, idx, backend=backend)
