"""Adapter slots on the device: preallocated pools and the host arrays written into one slot.

The pools (``models.step.LoraPools``: per layer one ``A_<group>`` and one ``B_<module>`` per module, in
the layout of the LoRA backend object, ``kernels.backends``, plus the DoRA-scale and LoRA-bias vectors of
``models.lora.dora_bias``; apart, the embed_tokens / lm_head pools of ``models.lora.embedding``, canonical for every
backend) are allocated once; a swap writes one slot through a jitted ``.at[slot].set`` on donated buffers, so shapes
never change and nothing compiles. The bookkeeping (which adapter is where, LRU, pins, host tier) is
``engine.slot_table`` (no JAX); ``SlotPools`` owns the device arrays and is touched only by the JAX runner
on the engine thread, which applies writes between decode steps (``with_scales``, which reads only the
base weights, runs on the loader thread).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loraserve.adapters.peft import LoraWeights, check_slot_value
from loraserve.kernels.backends import LoraBackend, pool_kind
from loraserve.models.config import ModelConfig
from loraserve.models.decoder import LORA_GROUPS, Lora
from loraserve.models.lora.dora_bias import (
    bias_name,
    dora_scale,
    is_vector_pool,
    magnitude_name,
    mask_name,
    scale_name,
)
from loraserve.models.lora.embedding import is_vocab_pool, vocab_slot_shapes, vocab_slot_values
from loraserve.models.lora.layout import b_name, empty_lora, lora_slot_shapes, lora_vector_sizes
from loraserve.models.moe import expert_slot_shapes, expert_slot_values, is_expert_pool, is_moe_pool
from loraserve.models.quantization import Quantized
from loraserve.models.step import LoraPools

# per layer, pool name -> one slot's array; layer 0 also holds the vocabulary pools' (LoraPools.vocab)
SlotValues = list[dict[str, np.ndarray]]
BaseWeights = list[
    dict[str, Any]
]  # per layer, LoRA group -> fused base weight [out, in] (or a quantized one)


def slot_arrays(cfg: ModelConfig, weights: LoraWeights, max_rank: int) -> SlotValues:
    """Host arrays for one slot, per layer, in the canonical layout of ``model.lora_slot_shapes``
    (``A_<group> [in, n*R]``, ``B_<module> [R, out]``), rank zero-padded to ``max_rank``; and per group
    the vectors of ``models.lora.dora_bias`` side by side like the fused output: ``magnitude_<group>``,
    ``dora_<group>`` (1.0 on DoRA channels) and ``lora_bias_<group>``, each ``[out]``.

    Semantics: untargeted modules (and layers) are zero, so they add exactly nothing; a module is DoRA
    (its scale computed by ``SlotPools.with_scales``) exactly in the layers where the adapter has its magnitude.
    """
    shapes = cfg.module_shapes()
    R = max_rank
    out: SlotValues = []
    for layer in range(cfg.num_layers):
        values: dict[str, np.ndarray] = {}
        for group, modules in cfg.lora_groups.items():
            fan_in = shapes[modules[0]][0]
            a_cat = np.zeros((fan_in, len(modules) * R), np.float32)
            vectors: dict[str, list[np.ndarray]] = {"m": [], "mask": [], "bias": []}
            for i, module in enumerate(modules):
                size = shapes[module][1]
                b = np.zeros((R, size), np.float32)
                if module in weights.modules:
                    a_m, b_m = weights.modules[module]
                    r = a_m.shape[2]
                    a_cat[:, i * R : i * R + r] = a_m[layer]
                    b[:r] = b_m[layer]
                values[b_name(module)] = b
                m, mask = weights.magnitudes.get(module, (None, None))
                dora = m is not None and bool(mask[layer])
                vectors["m"].append(m[layer] if dora else np.zeros(size, np.float32))
                vectors["mask"].append(np.full(size, 1.0 if dora else 0.0, np.float32))
                bias = weights.biases.get(module)
                vectors["bias"].append(bias[layer] if bias is not None else np.zeros(size, np.float32))
            values[f"A_{group}"] = a_cat
            values[magnitude_name(group)] = np.concatenate(vectors["m"])
            values[mask_name(group)] = np.concatenate(vectors["mask"])
            values[bias_name(group)] = np.concatenate(vectors["bias"])
        out.append(values)
    for values, experts in zip(out, expert_slot_values(cfg, weights.experts, max_rank), strict=True):
        values.update(experts)  # a mixture of experts' expert and router LoRA (models.moe)
    out[0].update(vocab_slot_values(cfg, weights, max_rank))  # embed_tokens / lm_head: layer 0 holds them
    return out


def check_slot_values(values: SlotValues) -> None:
    """INVALID_ARGUMENT unless every array one slot will hold (DoRA scales computed, a mix's weights folded
    in) is finite and within ``MAX_SLOT_VALUE``: the worker checks what it writes whatever the registry
    checked (``adapters.peft.check_slot_value``; names the layer and pool)."""
    for layer, vals in enumerate(values):
        for name, value in vals.items():
            check_slot_value(f"slot value {name} of layer {layer}", np.asarray(value))


def base_weights(params: dict[str, Any]) -> BaseWeights:
    """Per layer, LoRA group -> its fused base weight ``[out, in]`` (what DoRA's norm is taken of)."""
    keys = {"qkv": "wqkv", "o": "wo", "gate_up": "w_gate_up", "down": "w_down"}

    # a quantized projection (models.quantization) stays so here: _dora_scales dequantizes it only while it runs
    return [{group: layer[key] for group, key in keys.items() if key in layer} for layer in params["layers"]]


def _dora_scales(values: Lora, base: BaseWeights, shards: int) -> list[dict[str, jax.Array]]:
    """Per layer, ``dora_scale_<group> [out]`` of one slot's values (``models.lora.dora_bias.dora_scale``)."""
    out = []
    for n, vals in enumerate(values):
        scales = {}
        for group in base[n]:  # the groups the model has (a mixture of experts: attention's)
            bs = tuple(vals[b_name(m)] for m in LORA_GROUPS[group])
            w = base[n][
                group
            ]  # quantized (models.quantization): dequantized in f32 inside this jitted call only
            scales[scale_name(group)] = dora_scale(
                w.dequantize() if isinstance(w, Quantized) else w,
                vals[f"A_{group}"],
                bs,
                vals[magnitude_name(group)],
                vals[mask_name(group)],
                shards,
            )
        out.append(scales)
    return out


_dora_scales_jit = jax.jit(_dora_scales, static_argnames="shards")


def _write_slot(pools: LoraPools, slot: jax.Array, values: Lora, backend: LoraBackend) -> LoraPools:
    def put(name: str, pool: jax.Array, value: jax.Array) -> jax.Array:
        value = value.astype(
            pool.dtype
        )  # the models.lora.dora_bias vectors have one layout for every backend
        if is_expert_pool(name):  # expert-major [E, S, ...]
            return pool.at[:, slot].set(value)
        canonical = is_vector_pool(name) or is_vocab_pool(name) or is_moe_pool(name)
        return pool.at[slot].set(value if canonical else backend.to_pool_layout(value, pool_kind(name)))

    layers = [
        {k: put(k, v, vals[k]) for k, v in layer.items()}
        for layer, vals in zip(pools.layers, values, strict=True)
    ]
    return LoraPools(layers, {k: put(k, v, values[0][k]) for k, v in pools.vocab.items()})


_write_slot_jit = jax.jit(_write_slot, donate_argnames="pools", static_argnames="backend")


def is_scaled(values: SlotValues) -> bool:
    """Whether ``values`` already carry their ``dora_scale_<group>`` (:meth:`SlotPools.with_scales`)."""
    return scale_name("qkv") in values[0]


class SlotPools:
    """The device-resident pools. Only the engine thread calls ``write``/``zero``.

    Slot values are always given in the canonical layout (``slot_arrays``); ``backend`` decides how
    the pools store the matrices (``to_pool_layout`` runs inside the jitted write; the ``models.lora.dora_bias``
    vector pools are the same in every backend). ``shardings`` (pool name -> ``jax.sharding.Sharding``,
    tensor parallelism) places every layer's pools so and keeps them so across writes; None = the
    default device. ``base`` (``base_weights(params)``, on the device) is what DoRA slots' scales are
    computed from (:meth:`with_scales`); without it only non-DoRA values can be written.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: jnp.dtype,
        backend: LoraBackend,
        shardings: dict[str, Any] | None = None,
        base: BaseWeights | None = None,
    ) -> None:
        self.cfg, self.max_loras, self.max_rank, self.dtype = cfg, max_loras, max_rank, dtype
        self.backend, self.shardings, self.base = backend, shardings, base
        self.pools: LoraPools = empty_lora(cfg, max_loras, max_rank, dtype, backend)
        self._write, self._dora_scales = _write_slot_jit, _dora_scales_jit
        if shardings is not None:
            # the scales come back to the host whole: replicated, so a process of a multi-host mesh
            # (engine.multihost), which holds only its own devices' shards, can read them
            mesh = next(iter(shardings.values())).mesh
            self._dora_scales = jax.jit(
                _dora_scales, static_argnames="shards", out_shardings=NamedSharding(mesh, P())
            )
            layered = jax.tree.map_with_path(lambda path, _: shardings[path[-1].key], self.pools)
            self.pools = jax.device_put(self.pools, layered)
            self._write = jax.jit(
                _write_slot, donate_argnames="pools", static_argnames="backend", out_shardings=layered
            )
        zeros = {k: np.zeros(s, np.float32) for k, s in lora_slot_shapes(cfg, max_rank).items()}
        zeros.update({k: np.zeros(s, np.float32) for k, s in expert_slot_shapes(cfg, max_rank).items()})
        for group, size in lora_vector_sizes(cfg).items():
            zeros.update(
                {f(group): np.zeros(size, np.float32) for f in (magnitude_name, mask_name, bias_name)}
            )
        self._zeros: SlotValues = [zeros] * cfg.num_layers
        self._zeros[0] = {
            **zeros,
            **{k: np.zeros(s, np.float32) for k, s in vocab_slot_shapes(cfg, max_rank).items()},
        }
        self._zeros_scaled: SlotValues | None = None  # with their DoRA scales: computed by the first zero()

    def with_scales(self, values: SlotValues, on_device: bool = False) -> SlotValues:
        """``slot_arrays`` values -> the same with each group's magnitudes and DoRA mask replaced by its
        ``dora_scale_<group>`` (host arrays), computed on the device from the base weights.

        Thread-safe (reads only the base weights): the runner calls it on the loader thread, so a DoRA
        load's norm computation never runs between two decode steps. Values without a DoRA channel get
        their ones on the host (no copy to the device); ``on_device`` sends them through the compiled
        computation anyway, which ``zero`` does so that warm-up compiles it before any DoRA load.
        """
        if is_scaled(values):
            return values
        groups = [g for g in LORA_GROUPS if mask_name(g) in values[0]]  # the model's (see lora_groups)
        dora = any(np.any(v[mask_name(g)]) for v in values for g in groups)
        if dora and self.base is None:
            raise ValueError("a DoRA slot needs the base weights: SlotPools(..., base=base_weights(params))")
        if (dora or on_device) and self.base is not None:
            scales = jax.tree.map(
                np.asarray, self._dora_scales(values, self.base, shards=self.backend.shards)
            )
        else:
            scales = [
                {scale_name(g): np.ones(v[mask_name(g)].shape, np.float32) for g in groups} for v in values
            ]
        drop = {f(g) for g in groups for f in (magnitude_name, mask_name)}
        return [
            {**{k: v for k, v in vals.items() if k not in drop}, **sc}
            for vals, sc in zip(values, scales, strict=True)
        ]

    def write(self, slot: int, values: SlotValues) -> None:
        """Write one slot: a jitted, donated ``.at[slot].set`` (values without their DoRA scales get them
        first, :meth:`with_scales`, here on the calling thread)."""
        self.pools = self._write(
            pools=self.pools, slot=jnp.int32(slot), values=self.with_scales(values), backend=self.backend
        )

    def read(self, slot: int) -> SlotValues:
        """One slot back: matrices in the canonical layout, vectors as stored (host arrays); the vocabulary
        pools' in layer 0, as ``slot_arrays`` gives them."""

        def value(k: str, pool: jax.Array) -> np.ndarray:
            if is_expert_pool(k):
                return np.asarray(pool[:, slot])
            canonical = is_vector_pool(k) or is_vocab_pool(k) or is_moe_pool(k)
            return np.asarray(
                pool[slot] if canonical else self.backend.from_pool_layout(pool[slot], pool_kind(k))
            )

        out = [{k: value(k, pool) for k, pool in layer.items()} for layer in self.pools.layers]
        out[0].update({k: value(k, pool) for k, pool in self.pools.vocab.items()})
        return out

    def zero(self, slot: int) -> None:
        if self._zeros_scaled is None:  # the first call (warm-up) compiles the DoRA scales; kept after
            self._zeros_scaled = self.with_scales(self._zeros, on_device=True)
        self.write(slot, self._zeros_scaled)
