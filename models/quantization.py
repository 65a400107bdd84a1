"""Weight-only quantization of a base model's linear projections (``--quantization int8|int4``).

Each of a layer's fused projections (``wqkv``, ``wo``, ``w_gate_up``, ``w_down``, ``[out, in]``) becomes an
:class:`Int8Weight`: symmetric per-output-channel int8 values ``q = round(w / s)`` in [-127, 127] with
``s = max|w_row| / 127`` (f32), quantized once when the checkpoint is loaded. Activations, the KV cache,
norms, embeddings, the head (unless ``--quantize-lm-head``) and every adapter pool stay in the model's dtype; a mixture of experts keeps its
experts and router unquantized (attention is quantized). Split over devices (tensor parallelism) ``q`` is
split like the float weight and the scales with their output channels (column-parallel projections: split;
row-parallel ``wo`` / ``w_down``: whole), and the product is XLA's dot, which GSPMD partitions.

With ``--quantize-lm-head`` the head (``lm_head [vocab, hidden]``) is quantized the same way (int8: a scale per
vocabulary row; int4: per group of hidden inputs), split over devices like the float head (by vocabulary rows,
its scales with them). A model that ties its head to the embedding keeps the embedding in the model's dtype
for the lookup and gains a quantized copy for the head (``models.checkpoint.quantized_head``): a byte (int8) or half a byte
(int4) more a vocabulary entry's hidden value, and a decode step that reads that instead of the float matrix.

*Semantics:* ``qlinear(x, w) = (x @ q.T) * s`` with f32 accumulation (XLA's dot, or on a CPU for a
decode step's rows the C++ kernel ``kernels.cpu.linear_int8``, which reads the weights as bytes): "dequantize, then the same-dtype
matmul" up to the rounding of ``q * s`` (``q`` converts to the activation dtype exactly: |q| <= 127). A LoRA
delta is computed from ``x``, never from the weight, so adapters compute on a quantized base exactly what
they compute on the float one.

``int4`` (:class:`Int4Weight`) is group-wise: each row's inputs in groups of ``G`` (:func:`int4_group`: 128
when an eighth of the inputs is a multiple of it, as in every released model, else a smaller power of two),
one f32 scale per group ``s = max|w_group| / 7``,
``q = round(w / s)`` in [-7, 7], packed two to a byte (element ``2j`` in byte ``j``'s low nibble, ``2j + 1`` in
its high nibble, each stored as ``q + 8``): an eighth of f32's bytes plus a scale per 128 weights. Split over
devices the column-parallel projections split ``q`` and ``scale`` by rows, the row-parallel ones by columns
(whole groups: a device's share of the inputs must be a multiple of ``G``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.common.errors import FailedPrecondition
from loraserve.kernels.linear import current_backend

Array = jax.Array
QUANTIZATIONS = ("none", "int8", "int4")
QUANTIZED = ("wqkv", "wo", "w_gate_up", "w_down")  # a layer's projections that quantization covers
INT4_GROUP = 128  # inputs per int4 scale (at most; int4_group)
INT4_SPLIT = 8  # int4 groups stay whole when a projection's inputs are split over up to this many devices
_CONTRACT_MINOR = (((1,), (1,)), ((), ()))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Int8Weight:
    """An ``[out, in]`` weight as int8 values and one f32 scale per output row."""

    q: Array  # [out, in] int8
    scale: Array  # [out] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: Any = jnp.float32) -> Array:
        return (self.q.astype(jnp.float32) * self.scale[:, None]).astype(dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Int4Weight:
    """An ``[out, in]`` weight as packed int4 values (two a byte, module doc) and an f32 scale per group of
    ``group`` inputs of each row (``group`` follows from the shapes)."""

    q: Array  # [out, in // 2] uint8
    scale: Array  # [out, in // group] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.q.shape[0], 2 * self.q.shape[1])

    @property
    def group(self) -> int:
        return 2 * self.q.shape[1] // self.scale.shape[1]

    def dequantize(self, dtype: Any = jnp.float32) -> Array:
        out, half = self.q.shape
        values = unpack_int4(self.q).astype(jnp.float32).reshape(out, self.scale.shape[1], -1)
        return (values * self.scale[:, :, None]).reshape(out, 2 * half).astype(dtype)


Quantized = Int8Weight | Int4Weight  # what a quantized projection is


def int4_group(inputs: int) -> int:
    """The int4 group size for a projection with ``inputs`` columns: the largest power of two up to INT4_GROUP
    that divides ``inputs / INT4_SPLIT``, so that a row-parallel projection split over 2, 4 or 8 devices
    holds whole groups on each (4096 or 14336 inputs: 128; Llama-2's 11008: 32; a tiny test model's 64: 8);
    else the largest that divides ``inputs``. An odd count cannot be packed two a byte."""
    if inputs % 2:
        raise FailedPrecondition(f"int4 packs two inputs a byte; a projection with {inputs} inputs cannot")
    group = INT4_GROUP
    while group > 2 and inputs % (group * INT4_SPLIT):
        group //= 2
    while inputs % group:
        group //= 2
    return group


def quantize_int4(w: np.ndarray, group: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``w [out, in]`` -> (packed uint8 [out, in // 2], scale f32 [out, in // group]); a group of zeros gets
    scale 1 (and q 0)."""
    w = np.asarray(w, np.float32)
    out, inputs = w.shape
    group = group or int4_group(inputs)
    g = w.reshape(out, inputs // group, group)
    amax = np.abs(g).max(axis=2)
    scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(g / scale[:, :, None]), -7, 7).astype(np.int8).reshape(out, inputs)
    return pack_int4(q), scale


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Signed values in [-8, 7] ``[out, in]`` (``in`` even) -> uint8 ``[out, in // 2]`` (module doc's layout)."""
    u = (np.asarray(q, np.int16) + 8).astype(np.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: Any) -> Any:
    """uint8 ``[out, in // 2]`` -> int8 ``[out, in]`` in [-8, 7]; numpy in, numpy out; a jax array, jax."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    low = (packed & 0x0F).astype(xp.int8) - 8
    high = (packed >> 4).astype(xp.int8) - 8
    return xp.stack([low, high], axis=-1).reshape(packed.shape[0], 2 * packed.shape[1])


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [out, in]`` -> (q int8, scale f32 [out]); a row of zeros gets scale 1 (and q 0)."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def qlinear(x: Array, w: Quantized) -> Array:  # [..., out] f32
    """``x [..., in]`` times the quantized weight (module doc), f32 out. A decode step's few rows on a CPU go to
    the C++ kernels (``kernels.cpu.linear_int8`` / ``linear_int4``: the weights read as bytes, widened in
    registers), where XLA:CPU would first convert the whole matrix; a longer prefill, and other platforms,
    use XLA's dot (int8: on the int8 values; int4: on the dequantized weight, which XLA fuses)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xla, kernel = (_xla_int4, _kernel_int4) if isinstance(w, Int4Weight) else (_xla, _kernel)
    if (
        x2.shape[0] <= KERNEL_ROWS
        and x.dtype in (jnp.float32, jnp.bfloat16)
        and current_backend() != "xla"  # e.g. a model split over devices: GSPMD partitions XLA's dot
        and _kernel_available()
    ):
        y = jax.lax.platform_dependent(x2, w.q, w.scale, cpu=kernel, default=xla)
    else:
        y = xla(x2, w.q, w.scale)
    return y.reshape(*lead, w.q.shape[0])


KERNEL_ROWS = 64  # rows up to which the CPU kernels run (decode batches; measured faster than XLA's)


def _xla(x2: Array, q: Array, scale: Array) -> Array:
    y = jax.lax.dot_general(x2, q.astype(x2.dtype), _CONTRACT_MINOR, preferred_element_type=jnp.float32)
    return y * scale


def _xla_int4(x2: Array, q: Array, scale: Array) -> Array:
    w = Int4Weight(q, scale).dequantize(x2.dtype)
    return jax.lax.dot_general(x2, w, _CONTRACT_MINOR, preferred_element_type=jnp.float32)


def _kernel(x2: Array, q: Array, scale: Array) -> Array:
    from loraserve.kernels import cpu

    return cpu.linear_int8(x2, q, scale).T


def _kernel_int4(x2: Array, q: Array, scale: Array) -> Array:
    from loraserve.kernels import cpu

    return cpu.linear_int4(x2, q, scale).T


def _kernel_available() -> bool:
    from loraserve.kernels import cpu

    return cpu.available()
