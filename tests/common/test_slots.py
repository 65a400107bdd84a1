"""The shared slot-state and tier enums against the wire enums they stand for."""

from __future__ import annotations

import pytest

from loraserve.common.slots import SlotState, Tier, tier_proto
from loraserve.protos.v1 import placement_pb2, worker_admin_pb2


def test_every_slot_state_is_its_wire_value_both_ways() -> None:
    wire = worker_admin_pb2.SlotState
    assert {wire.Name(s.proto) for s in SlotState} == set(wire.keys()) - {"SLOT_STATE_UNSPECIFIED"}
    for state in SlotState:
        assert wire.Name(state.proto) == f"SLOT_STATE_{state}"
        assert SlotState.of_proto(state.proto) is state
    assert SlotState.of_proto(wire.Value("SLOT_STATE_UNSPECIFIED"), SlotState.LOADING) is SlotState.LOADING
    with pytest.raises(ValueError, match="no slot state for wire value 99"):
        SlotState.of_proto(99)


def test_every_tier_is_its_wire_value_both_ways_and_a_word_from_the_database_too() -> None:
    wire = placement_pb2.ResidencyTier
    assert {wire.Name(t.proto) for t in Tier} == set(wire.keys()) - {"RESIDENCY_TIER_UNSPECIFIED"}
    for tier in Tier:
        assert wire.Name(tier.proto) == f"RESIDENCY_TIER_{tier}"
        assert Tier.of_proto(tier.proto) is tier
        assert tier_proto(str(tier)) == tier.proto  # a plain string read back from a JSON column
    assert Tier.of_proto(placement_pb2.RESIDENCY_TIER_UNSPECIFIED) is None
    assert [tier_proto(t) for t in ("", None, "TAPE")] == [placement_pb2.RESIDENCY_TIER_UNSPECIFIED] * 3
    assert [t.word for t in Tier] == ["device", "host", "disk"]
    assert Tier("HOST") is Tier.HOST and Tier.HOST == "HOST"  # stored and read back as the very string
