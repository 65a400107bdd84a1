"""Adapter slots on the device: preallocated pools and the host arrays written into one slot.

The pools (per layer one ``A_<group>`` and one ``B_<module>`` per module, in the layout of the LoRA
backend object, ``kernels.backends``) are allocated once; a swap writes one
slot through a jitted ``.at[slot].set`` on donated buffers, so shapes never change and nothing compiles.
The bookkeeping (which adapter is where, LRU, pins, host tier) is ``worker.slot_table`` (no JAX);
``SlotPools`` owns the device arrays and is touched only by the JAX runner on the engine thread, which
applies writes between decode steps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.adapters.peft import LoraWeights
from loraserve.kernels.backends import LoraBackend
from loraserve.worker.model import LORA_GROUPS, Lora, b_name, empty_lora, lora_slot_shapes
from loraserve.worker.model_config import ModelConfig

SlotValues = list[dict[str, np.ndarray]]  # per layer, pool name -> one slot's array


def slot_arrays(cfg: ModelConfig, weights: LoraWeights, max_rank: int) -> SlotValues:
    """Host arrays for one slot, per layer, in the canonical layout of ``model.lora_slot_shapes``
    (``A_<group> [in, n*R]``, ``B_<module> [R, out]``), rank zero-padded to ``max_rank``.

    Semantics: untargeted modules (and layers) are zero, so they add exactly nothing.
    """
    shapes = cfg.module_shapes()
    R = max_rank
    out: SlotValues = []
    for layer in range(cfg.num_layers):
        values: dict[str, np.ndarray] = {}
        for group, modules in LORA_GROUPS.items():
            fan_in = shapes[modules[0]][0]
            a_cat = np.zeros((fan_in, len(modules) * R), np.float32)
            for i, module in enumerate(modules):
                b = np.zeros((R, shapes[module][1]), np.float32)
                if module in weights.modules:
                    a_m, b_m = weights.modules[module]
                    r = a_m.shape[2]
                    a_cat[:, i * R : i * R + r] = a_m[layer]
                    b[:r] = b_m[layer]
                values[b_name(module)] = b
            values[f"A_{group}"] = a_cat
        out.append(values)
    return out


def _write_slot(pools: Lora, slot: jax.Array, values: Lora, backend: LoraBackend) -> Lora:
    def put(pool: jax.Array, value: jax.Array) -> jax.Array:
        return pool.at[slot].set(backend.to_pool_layout(value.astype(pool.dtype)))

    return [{k: put(layer[k], vals[k]) for k in layer} for layer, vals in zip(pools, values, strict=True)]


_write_slot_jit = jax.jit(_write_slot, donate_argnums=0, static_argnums=3)


class SlotPools:
    """The device-resident pools. Only the engine thread calls ``write``/``zero``.

    Slot values are always given in the canonical layout (``slot_arrays``); ``backend`` decides how
    the pools store them (``to_pool_layout`` runs inside the jitted write). ``shardings`` (pool name ->
    ``jax.sharding.Sharding``, tensor parallelism) places every layer's pools so and keeps them so
    across writes; None = the default device.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: jnp.dtype,
        backend: LoraBackend,
        shardings: dict[str, Any] | None = None,
    ) -> None:
        self.cfg, self.max_loras, self.max_rank, self.dtype = cfg, max_loras, max_rank, dtype
        self.backend, self.shardings = backend, shardings
        self.pools: Lora = empty_lora(cfg, max_loras, max_rank, dtype, backend)
        self._write = _write_slot_jit
        if shardings is not None:
            layered = [dict(shardings) for _ in range(cfg.num_layers)]
            self.pools = jax.device_put(self.pools, layered)
            self._write = jax.jit(_write_slot, donate_argnums=0, static_argnums=3, out_shardings=layered)
        zeros = {k: np.zeros(s, np.float32) for k, s in lora_slot_shapes(cfg, max_rank).items()}
        self._zeros: SlotValues = [zeros] * cfg.num_layers

    def write(self, slot: int, values: SlotValues) -> None:
        self.pools = self._write(self.pools, jnp.int32(slot), values, self.backend)

    def read(self, slot: int) -> SlotValues:
        """One slot's values back in the canonical layout (host arrays in the pools' dtype)."""
        return [
            {k: np.asarray(self.backend.from_pool_layout(pool[slot])) for k, pool in layer.items()}
            for layer in self.pools
        ]

    def zero(self, slot: int) -> None:
        self.write(slot, self._zeros)
