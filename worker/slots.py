"""Adapter slots: preallocated device pools, which adapter sits where, LRU eviction, pinning, a host tier.

The pools (per layer one ``A_<group>`` and one ``B_<module>`` per module, in the layout of the LoRA
backend object, ``kernels.backends``) are allocated once; a swap writes one
slot through a jitted ``.at[slot].set`` on donated buffers, so shapes never change and nothing compiles.
``SlotTable`` is the bookkeeping (thread-safe, no JAX); ``SlotPools`` owns the device arrays and is
touched only by the engine thread, which applies writes between decode steps.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.adapters.peft import LoraWeights
from loraserve.kernels.backends import LoraBackend
from loraserve.worker.model import LORA_GROUPS, Lora, b_name, empty_lora, lora_slot_shapes
from loraserve.worker.model_config import ModelConfig


class SlotState(Enum):
    EMPTY = 1
    LOADING = 2
    LOADED = 3


class NoFreeSlotError(RuntimeError):
    """Every slot is pinned or in use by a running request."""


@dataclass
class Slot:
    index: int
    state: SlotState = SlotState.EMPTY
    adapter: str = ""  # resolved "name@version"
    sha256: str = ""
    rank: int = 0
    pinned: bool = False
    refcount: int = 0
    last_used: float = 0.0


class SlotTable:
    """Which adapter is in which slot; LRU over unreferenced, unpinned slots. Thread-safe."""

    def __init__(self, num_slots: int) -> None:
        self._slots = [Slot(i) for i in range(num_slots)]
        self._lock = threading.Lock()

    def snapshot(self) -> list[Slot]:
        with self._lock:
            return [Slot(**vars(s)) for s in self._slots]

    def find(self, adapter: str) -> Slot | None:
        with self._lock:
            return self._find(adapter)

    def _find(self, adapter: str) -> Slot | None:
        return next((s for s in self._slots if s.adapter == adapter and s.state != SlotState.EMPTY), None)

    def acquire(self, adapter: str) -> int | None:
        """Take a reference on a LOADED slot holding ``adapter``; None when it is not resident."""
        with self._lock:
            slot = self._find(adapter)
            if slot is None or slot.state != SlotState.LOADED:
                return None
            slot.refcount += 1
            slot.last_used = time.time()
            return slot.index

    def release(self, index: int) -> None:
        with self._lock:
            slot = self._slots[index]
            slot.refcount = max(0, slot.refcount - 1)
            slot.last_used = time.time()

    def reserve(self, adapter: str, *, sha256: str = "", rank: int = 0, pin: bool = False) -> tuple[int, str]:
        """Claim a slot for ``adapter`` (state LOADING); returns ``(slot, evicted adapter or "")``.

        Prefers an empty slot, else the least recently used loaded slot with refcount 0 that is not pinned.
        """
        with self._lock:
            empty = [s for s in self._slots if s.state == SlotState.EMPTY]
            victims = [
                s for s in self._slots if s.state == SlotState.LOADED and s.refcount == 0 and not s.pinned
            ]
            if empty:
                slot = empty[0]
            elif victims:
                slot = min(victims, key=lambda s: s.last_used)
            else:
                raise NoFreeSlotError(f"all {len(self._slots)} adapter slots are pinned or in use")
            evicted = slot.adapter if slot.state == SlotState.LOADED else ""
            slot.state, slot.adapter, slot.sha256, slot.rank = SlotState.LOADING, adapter, sha256, rank
            slot.pinned, slot.refcount, slot.last_used = pin, 0, time.time()
            return slot.index, evicted

    def mark_loaded(self, index: int) -> None:
        with self._lock:
            self._slots[index].state = SlotState.LOADED

    def set_pinned(self, index: int, pinned: bool) -> None:
        with self._lock:
            self._slots[index].pinned = pinned

    def clear(self, index: int) -> Slot:
        """Empty a slot (load failed, or unloaded); returns what it held."""
        with self._lock:
            old = Slot(**vars(self._slots[index]))
            self._slots[index] = Slot(index)
            return old

    def free_count(self) -> int:
        with self._lock:
            return sum(s.state == SlotState.EMPTY for s in self._slots)


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


@partial(jax.jit, donate_argnums=0, static_argnums=3)
def _write_slot(pools: Lora, slot: jax.Array, values: Lora, backend: LoraBackend) -> Lora:
    def put(pool: jax.Array, value: jax.Array) -> jax.Array:
        return pool.at[slot].set(backend.to_pool_layout(value.astype(pool.dtype)))

    return [{k: put(layer[k], vals[k]) for k in layer} for layer, vals in zip(pools, values, strict=True)]


class SlotPools:
    """The device-resident pools. Only the engine thread calls ``write``/``zero``.

    Slot values are always given in the canonical layout (``slot_arrays``); ``backend`` decides how
    the pools store them (``to_pool_layout`` runs inside the jitted write).
    """

    def __init__(
        self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: jnp.dtype, backend: LoraBackend
    ) -> None:
        self.cfg, self.max_loras, self.max_rank, self.dtype = cfg, max_loras, max_rank, dtype
        self.backend = backend
        self.pools: Lora = empty_lora(cfg, max_loras, max_rank, dtype, backend)
        zeros = {k: np.zeros(s, np.float32) for k, s in lora_slot_shapes(cfg, max_rank).items()}
        self._zeros: SlotValues = [zeros] * cfg.num_layers

    def write(self, slot: int, values: SlotValues) -> None:
        self.pools = _write_slot(self.pools, jnp.int32(slot), values, self.backend)

    def read(self, slot: int) -> SlotValues:
        """One slot's values back in the canonical layout (host arrays in the pools' dtype)."""
        return [
            {k: np.asarray(self.backend.from_pool_layout(pool[slot])) for k, pool in layer.items()}
            for layer in self.pools
        ]

    def zero(self, slot: int) -> None:
        self.write(slot, self._zeros)


class HostTier:
    """Recently evicted adapters' slot arrays in host memory (vLLM's max_cpu_loras), LRU. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[LoraWeights, SlotValues]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[LoraWeights, SlotValues] | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: str, item: tuple[LoraWeights, SlotValues]) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._items[key] = item
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)
