"""DoRA and LoRA-bias slot vectors: per-slot, per-output-channel scales and biases, and their maths.

Next to a slot's ``A``/``B`` matrices (``models.lora.pools``, laid out by the LoRA backend), every layer keeps
two vector pools per LoRA group (q|k|v, o, gate|up, down), each laid out like the group's fused output
(``[q | k | v]`` side by side; under tensor parallelism in the device order of ``models.sharding``'s
``fuse_order``, so device s holds its own output columns):

* ``dora_scale_<group> [S, out]`` float32: DoRA's ``m / ||W + s·B·A||`` per output channel (PEFT's
  ``DoraLinearLayer``: the L2 norm of each output row of the combined weight, over the input features),
  computed on the device once per load from the base weight ``W`` (:func:`dora_scale`, through
  ``SlotPools.with_scales`` on the loader thread: one compilation at warm-up, none per load); ones for
  plain-LoRA and empty slots.
* ``lora_bias_<group> [S, out]`` float32: ``lora_B``'s bias times the LoRA scaling (PEFT ``lora_bias``:
  ``(B(A x) + b) · s``); zeros elsewhere.

The model applies both to a layer's output after the backend's LoRA (:func:`apply_vectors`): it never
depends on the LoRA backend. PEFT's DoRA scales only the non-bias part of the base output
(``scale ⊙ (W x + s·B A x) + b``), so with a base bias ``b`` (Qwen2's q/k/v) the result is written as
``scale ⊙ y + (1 - scale) ⊙ b`` with ``y = W x + b + s·B A x``: bit-exact ``y`` for rows of scale 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array
VECTOR_DTYPE = jnp.float32


def scale_name(group: str) -> str:
    """Pool of DoRA scales of a LoRA group, e.g. ``qkv -> dora_scale_qkv`` ``[S, out]``."""
    return f"dora_scale_{group}"


def bias_name(group: str) -> str:
    """Pool of LoRA biases of a group (also the slot value's key), e.g. ``lora_bias_qkv`` ``[S, out]``."""
    return f"lora_bias_{group}"


def magnitude_name(group: str) -> str:
    """Slot value (host, not a pool): DoRA's magnitudes ``m [out]`` of the group, 0 outside DoRA modules."""
    return f"magnitude_{group}"


def mask_name(group: str) -> str:
    """Slot value (host, not a pool): ``[out]`` 1.0 on the output channels of DoRA modules, else 0.0."""
    return f"dora_{group}"


def is_vector_pool(name: str) -> bool:
    return name.startswith(("dora_scale_", "lora_bias_"))


def init_vector_pools(sizes: Mapping[str, int], num_slots: int) -> dict[str, Array]:
    """One layer's vector pools for groups ``sizes`` (``group -> fused out``): scales 1, biases 0.

    *Semantics:* every slot is a plain LoRA slot without bias (adds nothing to the LoRA result).
    """
    out: dict[str, Array] = {}
    for group, size in sizes.items():
        out[scale_name(group)] = jnp.ones((num_slots, size), VECTOR_DTYPE)
        out[bias_name(group)] = jnp.zeros((num_slots, size), VECTOR_DTYPE)
    return out


def join_fused(parts: Sequence[Array], shards: int) -> Array:
    """Parts ``[..., size_i]`` -> the fused ``[..., sum(size_i)]`` in the device layout (inverse of
    ``models.layers.split_fused``).

    *Semantics:* ``shards`` = 1: side by side; N > 1: N blocks, block s holding every part's s-th N-th.
    """
    if len(parts) == 1:
        return parts[0]
    if shards == 1:
        return jnp.concatenate(parts, axis=-1)
    lead = parts[0].shape[:-1]
    blocks = [p.reshape(*lead, shards, p.shape[-1] // shards) for p in parts]
    return jnp.concatenate(blocks, axis=-1).reshape(*lead, -1)


def dora_scale(
    w: Array,  # [out, in] the group's fused base weight (Hugging Face layout, device order)
    a: Array,  # [in, n*R] the slot's A (canonical layout), scaling folded into B
    bs: Sequence[Array],  # n x [R, out_i]
    magnitude: Array,  # [out] DoRA's m (device order), anything where mask is 0
    mask: Array,  # [out] 1.0 on DoRA output channels
    shards: int,
) -> Array:  # [out] float32
    """*Semantics:* ``where(mask, m / ||W + s·B·A||_row, 1)``, the norm over the input features of each
    output row of the combined weight, in f32 at highest precision; skipped (ones) when no channel is DoRA."""

    def compute(_: None) -> Array:
        r = bs[0].shape[0]
        deltas = [
            jnp.matmul(
                a[:, i * r : (i + 1) * r].astype(VECTOR_DTYPE),
                b.astype(VECTOR_DTYPE),
                precision=jax.lax.Precision.HIGHEST,
            )
            for i, b in enumerate(bs)
        ]  # [in, out_i]: (s·B·A)^T per module
        combined = w.astype(VECTOR_DTYPE).T + join_fused(deltas, shards)  # [in, out]
        norm = jnp.sqrt(jnp.sum(combined * combined, axis=0))
        return jnp.where(mask > 0, magnitude.astype(VECTOR_DTYPE) / norm, 1.0)

    ones = jnp.ones(magnitude.shape, VECTOR_DTYPE)
    return jax.lax.cond(jnp.any(mask > 0), compute, lambda _: ones, None)


def apply_vectors(
    y: Array,  # [G*k, out]: G groups of k consecutive rows (prefill segments of k tokens; decode: k = 1)
    pools: Mapping[str, Array],  # one layer's pools (dora_scale_<group>, lora_bias_<group>)
    group: str,
    slots: Array,  # [G] int32, slot of each group of rows; -1 (or outside [0, S)) = none
    bias: Array | None,  # [out] the base layer's bias (already in y), or None
) -> Array:  # [G*k, out]
    """*Semantics:* rows of slot s get ``scale[s] ⊙ (y - b) + b + lora_bias[s]`` (DoRA scales the non-bias
    part only, as PEFT does); rows without a slot, and plain-LoRA slots without bias, get ``y`` exactly."""
    scales, biases = pools[scale_name(group)], pools[bias_name(group)]
    g = slots.shape[0]
    valid = ((slots >= 0) & (slots < scales.shape[0]))[:, None]
    take = jnp.where(valid[:, 0], slots, 0)
    # the rows' vectors as arrays of their own: left to fuse, XLA:CPU gathers them again for every element
    # of the (unvectorised) fusion that applies them (3.0 -> ~0.8 ms a bf16 decode step of the bench model)
    scale, lora_bias = jax.lax.optimization_barrier(
        (jnp.where(valid, scales[take], 1.0)[:, None], jnp.where(valid, biases[take], 0.0)[:, None])
    )  # [G, 1, out] each
    yf = y.astype(VECTOR_DTYPE).reshape(g, -1, y.shape[-1])
    out = scale * yf + lora_bias
    if bias is not None:
        out = out + (1.0 - scale) * bias.astype(VECTOR_DTYPE)
    return out.reshape(y.shape).astype(y.dtype)
