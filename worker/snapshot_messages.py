"""The engine's snapshot as protos, the one place it becomes them: ``ListSlots``' ``SlotInfo``, the registry
heartbeat's occupied slots and load."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from loraserve.common.slots import SlotState
from loraserve.engine.slot_table import Slot
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.protos.v1 import placement_pb2, worker_admin_pb2


def slot_info(slot: Slot) -> worker_admin_pb2.SlotInfo:
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
    return placement_pb2.WorkerLoad(
        running=snap.running,
        waiting=snap.waiting,
        free_slots=snap.free_slots,
        utilization=snap.running / snap.max_batch_size,
    )
