"""A slot's state and where an adapter is held: one enum each for the worker, the registry, the router and
the CLI, both ways with the wire enums (``worker_admin.SlotState``, ``placement.ResidencyTier``).

The values are the words the registry's string columns hold (``placements.state``, ``workers.cached``),
so a member is stored as that very string and a string read back compares equal to its member.
"""

from __future__ import annotations

from enum import StrEnum

from loraserve.protos.v1 import placement_pb2, worker_admin_pb2


class SlotState(StrEnum):
    """A device slot: empty, an adapter being written into it, or one serving from it. The registry's
    ``placements`` rows are LOADING or LOADED (an empty slot has no row)."""

    EMPTY = "EMPTY"
    LOADING = "LOADING"
    LOADED = "LOADED"

    @property
    def proto(self) -> int:
        return _SLOT_TO_PROTO[self]

    @classmethod
    def of_proto(cls, value: int, default: SlotState | None = None) -> SlotState:
        """The member for a wire value; ``default`` (or ValueError) for UNSPECIFIED or an unknown one."""
        state = _SLOT_FROM_PROTO.get(value, default)
        if state is None:
            raise ValueError(f"no slot state for wire value {value}")
        return state


class Tier(StrEnum):
    """Where a worker holds an adapter, fastest first: a device slot, host memory, its disk cache
    (a worker that holds none of them makes a cold load from the object store)."""

    DEVICE = "DEVICE"
    HOST = "HOST"
    DISK = "DISK"

    @property
    def proto(self) -> int:
        return _TIER_TO_PROTO[self]

    @property
    def word(self) -> str:
        """How tables print it: "device", "host", "disk"."""
        return self.value.lower()

    @classmethod
    def of_proto(cls, value: int) -> Tier | None:
        """The member for a wire value; None for UNSPECIFIED (not held: a cold load) or an unknown one."""
        return _TIER_FROM_PROTO.get(value)


def tier_proto(tier: str | None) -> int:
    """The wire value of a tier word read from the database or a ``Candidate`` ("" or None: UNSPECIFIED)."""
    return _TIER_TO_PROTO.get(tier or "", placement_pb2.RESIDENCY_TIER_UNSPECIFIED)


_SLOT_TO_PROTO = {
    SlotState.EMPTY: worker_admin_pb2.SLOT_STATE_EMPTY,
    SlotState.LOADING: worker_admin_pb2.SLOT_STATE_LOADING,
    SlotState.LOADED: worker_admin_pb2.SLOT_STATE_LOADED,
}
_SLOT_FROM_PROTO = {v: k for k, v in _SLOT_TO_PROTO.items()}
_TIER_TO_PROTO = {
    Tier.DEVICE: placement_pb2.RESIDENCY_TIER_DEVICE,
    Tier.HOST: placement_pb2.RESIDENCY_TIER_HOST,
    Tier.DISK: placement_pb2.RESIDENCY_TIER_DISK,
}
_TIER_FROM_PROTO = {v: k for k, v in _TIER_TO_PROTO.items()}
