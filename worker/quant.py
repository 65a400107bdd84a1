"""Weight-only int8 quantization of a base model's linear projections (``--quantization int8``).

Each of a layer's fused projections (``wqkv``, ``wo``, ``w_gate_up``, ``w_down``, ``[out, in]``) becomes an
:class:`Int8Weight`: symmetric per-output-channel int8 values ``q = round(w / s)`` in [-127, 127] with
``s = max|w_row| / 127`` (f32), quantized once when the checkpoint is loaded. Activations, the KV cache,
norms, embeddings, the head and every adapter pool stay in the model's dtype; a mixture of experts keeps its
experts and router unquantized (attention is quantized). Split over devices (tensor parallelism) ``q`` is
split like the float weight and the scales with their output channels (column-parallel projections: split;
row-parallel ``wo`` / ``w_down``: whole), and the product is XLA's dot, which GSPMD partitions.

*Semantics:* ``qlinear(x, w) = (x @ q.T) * s`` with f32 accumulation (XLA's dot, or on a CPU for a
decode step's rows the C++ kernel ``kernels.cpu.linear_int8``, which reads the weights as bytes): "dequantize, then the same-dtype
matmul" up to the rounding of ``q * s`` (``q`` converts to the activation dtype exactly: |q| <= 127). A LoRA
delta is computed from ``x``, never from the weight, so adapters compute on a quantized base exactly what
they compute on the float one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.kernels.linear import current_backend

Array = jax.Array
QUANTIZATIONS = ("none", "int8")
QUANTIZED = ("wqkv", "wo", "w_gate_up", "w_down")  # a layer's projections that int8 covers
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


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [out, in]`` -> (q int8, scale f32 [out]); a row of zeros gets scale 1 (and q 0)."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def qlinear(x: Array, w: Int8Weight) -> Array:  # [..., out] f32
    """``x [..., in]`` times the int8 weight (module doc), f32 out. A decode step's few rows on a CPU go to
    the C++ kernel (``kernels.cpu.linear_int8``: the weights read as bytes, widened in registers), where
    XLA:CPU would first convert the whole matrix; a longer prefill, and other platforms, use XLA's dot."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if (
        x2.shape[0] <= KERNEL_ROWS
        and x.dtype in (jnp.float32, jnp.bfloat16)
        and current_backend() != "xla"  # e.g. a model split over devices: GSPMD partitions XLA's dot
        and _kernel_available()
    ):
        y = jax.lax.platform_dependent(x2, w.q, w.scale, cpu=_kernel, default=_xla)
    else:
        y = _xla(x2, w.q, w.scale)
    return y.reshape(*lead, w.q.shape[0])


KERNEL_ROWS = 64  # rows up to which the CPU kernel runs (decode batches; measured faster than XLA's int8)


def _xla(x2: Array, q: Array, scale: Array) -> Array:
    y = jax.lax.dot_general(x2, q.astype(x2.dtype), _CONTRACT_MINOR, preferred_element_type=jnp.float32)
    return y * scale


def _kernel(x2: Array, q: Array, scale: Array) -> Array:
    from loraserve.kernels import cpu

    return cpu.linear_int8(x2, q, scale).T


def _kernel_available() -> bool:
    from loraserve.kernels import cpu

    return cpu.available()


def quantize_layers(layers: list[dict[str, Any]], host: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
    """Each layer with its QUANTIZED projections replaced by Int8Weights made from the f32 ``host`` arrays."""
    out = []
    for layer, values in zip(layers, host, strict=True):
        layer = dict(layer)
        for key in QUANTIZED:
            if key in values:
                q, s = quantize_int8(values[key])
                layer[key] = Int8Weight(jax.device_put(q), jax.device_put(s))
        out.append(layer)
    return out
