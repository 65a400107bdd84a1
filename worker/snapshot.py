"""What the engine looks like after a step: one immutable value, and the ONE place it becomes protos.

The engine thread publishes a new ``EngineSnapshot`` after every step and every batch of commands;
the servicers (``ListSlots``), the registry heartbeat and the Prometheus collector read the latest one
and never the engine's private state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraserve.common.slots import SlotState
from loraserve.worker.slot_table import Slot

if TYPE_CHECKING:
    from loraserve.protos.v1 import placement_pb2, worker_admin_pb2


@dataclass(frozen=True)
class EngineSnapshot:
    step: int  # decode steps run so far
    slots: tuple[Slot, ...]
    running: int  # requests holding a decode row
    waiting: int  # accepted, not yet running (queued or waiting for their adapter)
    running_adapters: tuple[str, ...]  # resolved keys of running requests, sorted, unique
    waiting_adapters: tuple[str, ...]  # refs of waiting requests, sorted, unique
    adapter_loads: int  # adapters written into a slot
    tokens_out: int
    requests_done: int  # requests that ran and finished or failed
    host_tier: tuple[str, ...]  # keys of adapters kept in host memory, oldest first
    max_batch_size: int
    # paged KV cache (worker.kv_cache); pages exclude the reserved null page
    kv_page_size: int = 0  # tokens per page
    kv_pages_total: int = 0  # usable pages in the pool
    kv_pages_used: int = 0  # referenced by running requests
    kv_pages_cached: int = 0  # referenced by nobody, holding a cached prefix (reusable, reclaimed LRU)
    prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    prefix_query_tokens: int = 0  # prompt tokens looked up in it (0 with prefix caching off)
    preemptions: int = 0  # running requests sent back to the queue for want of pages
    cancelled: tuple[tuple[str, int], ...] = ()  # (reason, requests ended early): scheduler.CANCEL_REASONS
    # per cancel that ended a request, the tokens it took after the cancel was posted, counted by
    # scheduler.AFTER_CANCEL_BUCKETS (one more: above them), and their sum
    after_cancel: tuple[int, ...] = ()
    after_cancel_tokens: int = 0

    @property
    def kv_utilisation(self) -> float:
        """Pages held by running requests over usable pages, 0-1 (cached idle pages count as free)."""
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0

    @property
    def free_slots(self) -> int:
        return sum(s.state == SlotState.EMPTY for s in self.slots)

    @property
    def used_slots(self) -> int:
        return len(self.slots) - self.free_slots

    def slot_of(self, adapter: str) -> Slot | None:
        return next((s for s in self.slots if s.adapter == adapter and s.state != SlotState.EMPTY), None)


# The generated modules are imported where a proto is made: the engine itself runs without them (bench/device.sh
# on a machine where they were not generated and grpcio-tools is not installed).
def slot_info(slot: Slot) -> worker_admin_pb2.SlotInfo:
    from google.protobuf.timestamp_pb2 import Timestamp

    from loraserve.protos.v1 import worker_admin_pb2

    info = worker_admin_pb2.SlotInfo(
        slot=slot.index,
        adapter=slot.adapter,
        state=slot.state.proto,
        pinned=slot.pinned,
        refcount=slot.refcount,
        rank=slot.rank,
        sha256=slot.sha256,
    )
    if slot.last_used:
        info.last_used.CopyFrom(Timestamp(seconds=int(slot.last_used), nanos=int(slot.last_used % 1 * 1e9)))
    return info


def occupied_slot_infos(snap: EngineSnapshot) -> list[worker_admin_pb2.SlotInfo]:
    """The slots holding (or loading) an adapter, as the registry's heartbeat wants them."""
    return [slot_info(s) for s in snap.slots if s.state != SlotState.EMPTY]


def worker_load(snap: EngineSnapshot) -> placement_pb2.WorkerLoad:
    from loraserve.protos.v1 import placement_pb2

    return placement_pb2.WorkerLoad(
        running=snap.running,
        waiting=snap.waiting,
        free_slots=snap.free_slots,
        utilization=snap.running / snap.max_batch_size,
    )
