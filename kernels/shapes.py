"""Shape checks and small helpers shared by every backend of the batched multi-LoRA ops.

All checks run at trace time on static shapes, so they cost nothing inside ``jax.jit`` and raise a
``ValueError`` that names the offending argument instead of an opaque XLA shape error.

Conventions used by every backend (see docs/design.md §6):

* ``x``   ``[T, in]``      activations of T tokens.
* ``A``   ``[S, in, R]``   the LoRA "down" matrices of S adapter slots, rank zero-padded to R.
* ``B``   ``[S, R, out]``  the LoRA "up" matrices (scaling already folded in by the worker).
* ``idx`` ``[T]`` int      slot of each token; any value outside ``[0, S)`` (normally −1) means
  "no adapter" and contributes exactly 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

ACC_DTYPE = jnp.float32  # every backend accumulates in f32


def operand_precision(*operands) -> jax.lax.Precision | None:
    """The ``precision=`` of a product of ``operands``: ``DEFAULT`` when every one is 16-bit (one MXU pass
    multiplies bf16 exactly; Mosaic refuses a float32 contract precision on bf16 operands, which a process-wide
    ``jax.default_matmul_precision("highest")`` would ask of a Pallas kernel or of ``ragged_dot``'s TPU
    lowering), else None: the caller's ``default_matmul_precision`` (``EngineConfig.matmul_precision``)."""
    if all(jnp.dtype(a.dtype).itemsize <= 2 for a in operands):
        return jax.lax.Precision.DEFAULT
    return None


def _shape(name: str, a, ndim: int) -> tuple[int, ...]:
    shape = tuple(a.shape)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {shape}")
    return shape


def check_idx(idx, T: int) -> None:
    """Validate the per-token slot ids: int dtype, shape ``[T]``."""
    (n,) = _shape("idx", idx, 1)
    if n != T:
        raise ValueError(f"idx has {n} entries but there are {T} tokens")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"idx must be an integer array, got {idx.dtype}")


def check_shrink(x, A, idx) -> tuple[int, int, int, int]:
    """Validate ``lora_shrink`` arguments; returns ``(T, in, S, R)``."""
    T, d_in = _shape("x", x, 2)
    S, a_in, R = _shape("A", A, 3)
    if a_in != d_in:
        raise ValueError(f"A is [S, in={a_in}, R] but x is [T, in={d_in}]")
    check_idx(idx, T)
    return T, d_in, S, R


def check_expand(h, B, idx, y) -> tuple[int, int, int, int]:
    """Validate ``lora_expand`` arguments; returns ``(T, R, S, out)``."""
    T, R = _shape("h", h, 2)
    S, b_r, d_out = _shape("B", B, 3)
    if b_r != R:
        raise ValueError(f"B is [S, R={b_r}, out] but h is [T, R={R}]")
    if tuple(y.shape) != (T, d_out):
        raise ValueError(f"y must be [T={T}, out={d_out}], got {tuple(y.shape)}")
    check_idx(idx, T)
    return T, R, S, d_out


def check_slices(h, Bs: Sequence, idx, y) -> tuple[int, list[int]]:
    """Validate ``lora_expand_slices`` arguments; returns ``(R, [out_i])``.

    ``h`` is ``[T, n*R]`` (slice i in columns ``i*R:(i+1)*R``), ``Bs[i]`` is ``[S, R, out_i]`` and
    ``y`` is ``[T, sum(out_i)]``.
    """
    if isinstance(Bs, (str, bytes)) or not isinstance(Bs, Sequence) or len(Bs) == 0:
        raise ValueError("Bs must be a non-empty tuple of [S, R, out_i] arrays")
    T, nR = _shape("h", h, 2)
    n = len(Bs)
    if nR % n:
        raise ValueError(f"h has {nR} columns, not a multiple of the {n} slices")
    R = nR // n
    S = None
    outs = []
    for i, b in enumerate(Bs):
        s, r, o = _shape(f"Bs[{i}]", b, 3)
        if r != R:
            raise ValueError(f"Bs[{i}] has rank {r} but h gives {R} columns per slice")
        if S is not None and s != S:
            raise ValueError(f"Bs[{i}] has {s} slots but Bs[0] has {S}")
        S = s
        outs.append(o)
    if tuple(y.shape) != (T, sum(outs)):
        raise ValueError(f"y must be [T={T}, sum(out_i)={sum(outs)}], got {tuple(y.shape)}")
    check_idx(idx, T)
    return R, outs


def slice_offsets(outs: Sequence[int]) -> list[int]:
    """Column offset of each slice in the fused output: ``[0, out_0, out_0+out_1, …]``."""
    offs, acc = [], 0
    for o in outs:
        offs.append(acc)
        acc += o
    return offs


def valid_rows(idx, S: int):  # [T] bool
    """*Semantics:* True where the token has an adapter, i.e. ``0 <= idx < S``."""
    return (idx >= 0) & (idx < S)


def shrink_out_dtype(x, out_dtype):
    """The dtype ``lora_shrink`` returns: ``out_dtype`` if given, else x's dtype."""
    return jnp.dtype(out_dtype) if out_dtype is not None else x.dtype


def expand_slices_generic(expand, h, Bs, idx, y, **kw):  # [T, sum(out_i)]
    """Run a single-slice ``expand`` once per slice on column ranges of ``y`` and concatenate.

    *Semantics:* ``out[:, off_i:off_i+out_i] = expand(h[:, i*R:(i+1)*R], Bs[i], idx, y[:, off_i:…])``.
    """
    R, outs = check_slices(h, Bs, idx, y)
    parts = []
    for i, (off, o) in enumerate(zip(slice_offsets(outs), outs, strict=True)):
        parts.append(expand(h[:, i * R : (i + 1) * R], Bs[i], idx, y[:, off : off + o], **kw))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
