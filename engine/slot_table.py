"""Host-side slot bookkeeping (no JAX): which adapter sits in which device slot, LRU, pins, a host tier.

``SlotTable`` is owned by the engine thread (``engine.residency``); its entries are frozen ``Slot``
values, replaced on every change, so a snapshot is just the tuple of current entries. ``HostTier``
keeps recently prepared adapters' host arrays and is read and written by the loader threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from loraserve.common.slots import SlotState


class NoFreeSlotError(RuntimeError):
    """Every slot is pinned or in use by a running request."""


@dataclass(frozen=True)
class Slot:
    """One device slot as the host sees it; ``adapter`` is the resolved ``name@version``."""

    index: int
    state: SlotState = SlotState.EMPTY
    adapter: str = ""
    sha256: str = ""
    rank: int = 0
    pinned: bool = False
    refcount: int = 0
    last_used: float = 0.0
    loaded_seq: int = 0  # the order slots were filled in: the one held longest changes hands first


class SlotTable:
    """Which adapter is in which slot; LRU over unreferenced, unpinned slots. Engine thread only."""

    def __init__(self, num_slots: int, clock=time.time) -> None:
        self._slots = [Slot(i) for i in range(num_slots)]
        self._clock = clock
        self._filled = 0

    def slots(self) -> tuple[Slot, ...]:
        return tuple(self._slots)

    def find(self, adapter: str) -> Slot | None:
        return next((s for s in self._slots if s.adapter == adapter and s.state != SlotState.EMPTY), None)

    def acquire(self, adapter: str) -> int | None:
        """Take a reference on a LOADED slot holding ``adapter``; None when it is not resident."""
        slot = self.find(adapter)
        if slot is None or slot.state != SlotState.LOADED:
            return None
        self._slots[slot.index] = replace(slot, refcount=slot.refcount + 1, last_used=self._clock())
        return slot.index

    def release(self, index: int) -> None:
        slot = self._slots[index]
        self._slots[index] = replace(slot, refcount=max(0, slot.refcount - 1), last_used=self._clock())

    def reserve(
        self,
        adapter: str,
        *,
        sha256: str = "",
        rank: int = 0,
        pin: bool = False,
        prefer: frozenset[int] = frozenset(),
    ) -> tuple[int, str]:
        """Claim a slot for ``adapter`` (state LOADING); returns ``(slot, evicted adapter or "")``.

        Prefers the lowest empty slot, else an unreferenced, unpinned loaded slot: one of ``prefer`` (slots
        being drained for a waiting load) first, else the least recently used (ties: the lowest index).
        """
        empty = [s for s in self._slots if s.state == SlotState.EMPTY]
        victims = [s for s in self._slots if s.state == SlotState.LOADED and s.refcount == 0 and not s.pinned]
        if empty:
            slot = empty[0]
        elif victims:
            slot = min(victims, key=lambda s: (s.index not in prefer, s.last_used, s.index))
        else:
            raise NoFreeSlotError(f"all {len(self._slots)} adapter slots are pinned or in use")
        evicted = slot.adapter if slot.state == SlotState.LOADED else ""
        self._filled += 1
        self._slots[slot.index] = Slot(
            slot.index, SlotState.LOADING, adapter, sha256, rank, pin, 0, self._clock(), self._filled
        )
        return slot.index, evicted

    def mark_loaded(self, index: int) -> None:
        self._slots[index] = replace(self._slots[index], state=SlotState.LOADED)

    def set_pinned(self, index: int, pinned: bool) -> None:
        self._slots[index] = replace(self._slots[index], pinned=pinned)

    def clear(self, index: int) -> Slot:
        """Empty a slot (unloaded); returns what it held."""
        old = self._slots[index]
        self._slots[index] = Slot(index)
        return old

    def free_count(self) -> int:
        return sum(s.state == SlotState.EMPTY for s in self._slots)


class HostTier:
    """Recently prepared adapters' host arrays (vLLM's max_cpu_loras), LRU by use. Thread-safe.

    Items are whatever the runner prepares for a slot (``(LoraWeights, host arrays)`` for the JAX runner).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: str, item: Any) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._items[key] = item
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def drop(self, key: str) -> bool:
        """Forget ``key`` (a deleted adapter); whether it was held."""
        with self._lock:
            return self._items.pop(key, None) is not None

    def keys(self) -> tuple[str, ...]:
        """Oldest first."""
        with self._lock:
            return tuple(self._items)
