"""The layers every family shares, in JAX: RMSNorm (Llama's and Gemma's ``1 + w``), the MLP activation,
soft-capping, RoPE (and a layer's table, for families with sliding-window layers), fused projections and their
split, a linear layer over float or quantized weights. ``models.decoder`` builds the steps from them;
``models.moe`` shares the activation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.kernels.linear import linear
from loraserve.models.config import ModelConfig
from loraserve.models.quantization import Quantized, qlinear

Array = jax.Array


def rms_norm(x: Array, w: Array, eps: float, offset: bool = False) -> Array:
    """x [..., H], w [H] -> [..., H]. Semantics: x / rms(x) (in f32) times w, as transformers does it:
    rounded to x's dtype, then times w (Llama); or times ``1 + w`` in f32, then rounded (``offset``, Gemma)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return (y.astype(x.dtype) * w).astype(x.dtype)


def norm(cfg: ModelConfig, x: Array, w: Array) -> Array:
    return rms_norm(x, w, cfg.rms_norm_eps, cfg.gemma_norm)


def activation(cfg: ModelConfig, x: Array) -> Array:
    """The MLP's gate activation in f32: silu, or gelu_pytorch_tanh (the tanh approximation)."""
    xf = x.astype(jnp.float32)
    return jax.nn.gelu(xf, approximate=True) if cfg.hidden_act == "gelu_pytorch_tanh" else jax.nn.silu(xf)


def softcap(x: Array, cap: float | None) -> Array:
    """Semantics: tanh(x / cap) * cap (Gemma's soft-capping); identity when cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def layer_inv_freq(cfg: ModelConfig, inv_freq: Array, layer: int) -> Array:
    """inv_freq [D/2] (one table) or [2, D/2] (global, local) -> this layer's table [D/2]."""
    if inv_freq.ndim == 1:
        return inv_freq
    return inv_freq[1 if cfg.is_sliding(layer) else 0]


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """x [..., T, heads, D], positions [..., T] -> same shape. Semantics: HF rotate-half rotary embedding."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[..., None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[..., None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def split_fused(y: Array, sizes: tuple[int, ...], shards: int) -> list[Array]:
    """y ``[..., sum(sizes)]`` -> the parts ``[..., size_i]`` of a fused projection (q|k|v, gate|up).

    *Semantics:* with ``shards`` = 1, y is the parts side by side; with N > 1 (tensor parallelism) y is
    N blocks, block s holding every part's s-th N-th side by side (``models.sharding.fuse_order``), so
    each device's output columns carry its own q, k, v (gate, up).
    """
    if shards == 1:
        return jnp.split(y, [int(c) for c in np.cumsum(sizes)[:-1]], axis=-1)
    lead = y.shape[:-1]
    local = [size // shards for size in sizes]
    blocks = jnp.split(y.reshape(*lead, shards, sum(local)), [int(c) for c in np.cumsum(local)[:-1]], axis=-1)
    return [blk.reshape(*lead, size) for blk, size in zip(blocks, sizes, strict=True)]


def matmul(x: Array, w: Array | Quantized, b: Array | None) -> Array:
    y = (qlinear(x, w) if isinstance(w, Quantized) else linear(x, w)).astype(x.dtype)
    return y if b is None else y + b
