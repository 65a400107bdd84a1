"""Fleet.rank (LocateAdapter's ranking) against the ranking spelled out as one sort over the whole fleet.

rank reads an index built once per change of the fleet view instead of sorting every worker per call;
on random fleets (models, loads, free slots, held and cached adapters, expired leases) it must pick the
same workers in the same order with the same tiers as the plain sort of the ranking rule (docs/registry.md,
"Placement")."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.registry.placement import TIERS, Fleet, LiveWorker, ReportedLoad

NOW = datetime(2026, 12, 3, tzinfo=UTC)
ADAPTERS = ["a@1", "b@1", "c@2", "d@1"]


def spec_rank(workers: list[LiveWorker], key: str, model: str | None, limit: int) -> list[tuple[str, str]]:
    """Device slot > host memory > disk cache (least busy first), then free slots (most free, then least
    busy), then the least busy; ties by worker id; only live workers of ``model``."""

    def tier(w: LiveWorker) -> str:
        return ("DEVICE" if key in w.holds else w.cached.get(key, "")) if key else ""

    def order(w: LiveWorker) -> tuple:
        busy, t = w.load.running + w.load.waiting, tier(w)
        if t:
            return (TIERS.index(t), busy, 0, w.id)
        if w.load.free_slots > 0:
            return (3, -w.load.free_slots, busy, w.id)
        return (4, busy, 0, w.id)

    live = [w for w in workers if w.lease_expires_at > NOW and (model is None or w.model_id == model)]
    return [(w.id, tier(w)) for w in sorted(live, key=order)[:limit]]


workers_st = st.lists(
    st.builds(
        lambda i, model, running, waiting, free, held, cached, alive: LiveWorker(
            id=f"w{i:02d}",
            address=f"10.0.0.{i}:1",
            model_id=model,
            lease_expires_at=NOW + timedelta(seconds=5 if alive else -1),
            load=ReportedLoad(running, waiting, free),
            cached=cached,
            holds=frozenset(held),
        ),
        st.integers(0, 40),
        st.sampled_from(["m1", "m2"]),
        st.integers(0, 3),
        st.integers(0, 2),
        st.integers(0, 3),
        st.sets(st.sampled_from(ADAPTERS), max_size=3),
        st.dictionaries(st.sampled_from(ADAPTERS), st.sampled_from(["HOST", "DISK"]), max_size=3),
        st.booleans(),
    ),
    max_size=25,
    unique_by=lambda w: w.id,
)


@settings(max_examples=300, deadline=None)
@given(
    workers=workers_st,
    key=st.sampled_from(["", *ADAPTERS, "never@1"]),
    model=st.sampled_from([None, "m1", "m2", "m3"]),
    limit=st.integers(1, 16),
)
def test_rank_equals_the_sort_over_the_whole_fleet(workers, key, model, limit) -> None:
    fleet = Fleet(sessions=None, ttl_s=float("inf"))  # never re-read: the view is what was put
    for w in workers:
        fleet.put(w)
    got = [(w.id, tier) for w, tier in fleet.rank(key, model, limit, NOW)]
    assert got == spec_rank(workers, key, model, limit)


def test_rank_follows_each_change_of_the_view() -> None:
    """The index is rebuilt after a put or a drop: a new holder comes first, a dropped one is gone."""
    fleet = Fleet(sessions=None, ttl_s=float("inf"))
    base = dict(address="x:1", model_id="m1", lease_expires_at=NOW + timedelta(seconds=5))
    fleet.put(LiveWorker(id="w1", load=ReportedLoad(0, 0, 2), **base))
    fleet.put(LiveWorker(id="w2", load=ReportedLoad(0, 0, 1), **base))
    assert [(w.id, t) for w, t in fleet.rank("a@1", "m1", 3, NOW)] == [("w1", ""), ("w2", "")]
    fleet.put(LiveWorker(id="w2", load=ReportedLoad(4, 0, 0), holds=frozenset({"a@1"}), **base))
    assert [(w.id, t) for w, t in fleet.rank("a@1", "m1", 3, NOW)] == [("w2", "DEVICE"), ("w1", "")]
    fleet.put(LiveWorker(id="w1", load=ReportedLoad(0, 0, 2), cached={"a@1": "HOST"}, **base))
    assert [(w.id, t) for w, t in fleet.rank("a@1", "m1", 1, NOW)] == [("w2", "DEVICE")]
    fleet.drop("w2")
    assert [(w.id, t) for w, t in fleet.rank("a@1", "m1", 3, NOW)] == [("w1", "HOST")]
    assert fleet.rank("a@1", "m2", 3, NOW) == []
