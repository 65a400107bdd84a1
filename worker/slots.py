"""Adapter slots on the device: preallocated pools and the host arrays written into one slot.

The pools (per layer ``A_*: [S, in, n*R]``, ``B_*: [S, R, out]``) are allocated once; a swap writes one
slot through a jitted ``.at[slot].set`` on donated buffers, so shapes never change and nothing compiles.
The bookkeeping (which adapter is where, LRU, pins, host tier) is ``worker.slot_table`` (no JAX);
``SlotPools`` owns the device arrays and is touched only by the JAX runner on the engine thread, which
applies writes between decode steps.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.adapters.peft import LoraWeights
from loraserve.worker.model import LORA_GROUPS, Lora, b_name, empty_lora, weights_first
from loraserve.worker.model_config import ModelConfig

SlotValues = list[dict[str, np.ndarray]]  # per layer, pool name -> one slot's array


def slot_arrays(cfg: ModelConfig, weights: LoraWeights, max_rank: int) -> SlotValues:
    """Host arrays for one slot (per layer, pool shapes without the S axis), rank zero-padded to ``max_rank``.

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


@partial(jax.jit, donate_argnums=0, static_argnums=3)
def _write_slot(pools: Lora, slot: jax.Array, values: Lora, transpose: bool) -> Lora:
    def put(pool: jax.Array, value: jax.Array) -> jax.Array:
        value = value.astype(pool.dtype)
        return pool.at[slot].set(value.T if transpose else value)

    return [{k: put(layer[k], vals[k]) for k in layer} for layer, vals in zip(pools, values, strict=True)]


class SlotPools:
    """The device-resident pools. Only the engine thread calls ``write``/``zero``.

    Slot values are always given as ``A [in, n*R]`` / ``B [R, out]`` (``slot_arrays``); pools of a
    weights-first backend (``worker.model.weights_first``) store them transposed.
    """

    def __init__(
        self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: jnp.dtype, backend: str = "xla"
    ) -> None:
        self.cfg, self.max_loras, self.max_rank, self.dtype = cfg, max_loras, max_rank, dtype
        self.transpose = weights_first(backend)
        self.pools: Lora = empty_lora(cfg, max_loras, max_rank, dtype, backend)
        self._zeros = [
            {
                k: np.zeros(v.shape[1:][::-1] if self.transpose else v.shape[1:], np.float32)
                for k, v in layer.items()
            }
            for layer in self.pools
        ]

    def write(self, slot: int, values: SlotValues) -> None:
        self.pools = _write_slot(self.pools, jnp.int32(slot), values, self.transpose)

    def zero(self, slot: int) -> None:
        self.write(slot, self._zeros)
