"""Placement over real gRPC: registration with a lease, heartbeats, ranking on a constructed fleet, expiry."""

from __future__ import annotations

import grpc
import pytest

from loraserve.protos.v1 import placement_pb2 as pp
from loraserve.protos.v1 import worker_admin_pb2 as wa
from tests.registry.conftest import TINY_MODEL


def _register(reg, address, shapes, slots=4, model=TINY_MODEL) -> str:
    req = pp.RegisterWorkerRequest(
        address=address,
        model_id=model,
        slots=slots,
        max_lora_rank=16,
        max_batch_size=8,
        module_shapes=[
            pp.ModuleShape(module=m, in_features=i, out_features=o, num_layers=n)
            for m, (i, o, n) in shapes.items()
        ],
    )
    asked = reg.registry.clock.now().timestamp()  # the registry's clock: a ManualClock stands still
    resp = reg.client.placement.RegisterWorker(req)
    # the lease runs from the registration: it ends after we asked (whole and fractional seconds; a loaded
    # machine may take longer than the 2 s lease to answer, so "after the answer" would be flaky; and on a
    # registry's ManualClock, time.time() runs past its leases while fixtures set up on a loaded machine)
    expires = resp.lease_expires_at.seconds + resp.lease_expires_at.nanos / 1e9
    assert resp.lease_seconds == 2 and expires > asked
    return resp.worker_id


def _beat(reg, worker_id, adapters=(), running=0, waiting=0, free=None, slots=4):
    infos = [wa.SlotInfo(slot=i, adapter=a, state=wa.SLOT_STATE_LOADED) for i, a in enumerate(adapters)]
    load = pp.WorkerLoad(
        running=running, waiting=waiting, free_slots=slots - len(adapters) if free is None else free
    )
    return reg.client.placement.Heartbeat(pp.HeartbeatRequest(worker_id=worker_id, slots=infos, load=load))


def test_locate_ranks_holders_then_free_slots_then_load(reg, adapter_dirs, tiny_shapes) -> None:
    reg.client.push(adapter_dirs["all-r4"], "hot", TINY_MODEL)
    reg.client.push(adapter_dirs["all-r4"], "cold", TINY_MODEL)
    w = {
        name: _register(reg, f"10.0.0.{i}:1", tiny_shapes)
        for i, name in enumerate(["busy-holder", "idle-holder", "free", "full-idle", "full-busy"], 1)
    }
    other = _register(reg, "10.0.0.9:1", tiny_shapes, model="other-model")
    _beat(reg, w["busy-holder"], ["hot@1"], running=5)
    _beat(reg, w["idle-holder"], ["hot@1"], running=1)
    _beat(reg, w["free"], [], running=3)
    _beat(reg, w["full-idle"], ["x@1", "y@1", "z@1", "q@1"], running=0)
    _beat(reg, w["full-busy"], ["x@1", "y@1", "z@1", "q@1"], running=7)
    _beat(reg, other, ["hot@1"])
    resp = reg.client.placement.LocateAdapter(pp.LocateAdapterRequest(adapter="hot", max_candidates=5))
    assert resp.adapter == "hot@1"
    assert [c.worker_id for c in resp.candidates] == [
        w["idle-holder"],
        w["busy-holder"],
        w["free"],
        w["full-idle"],
        w["full-busy"],
    ]
    assert [c.holds_adapter for c in resp.candidates] == [True, True, False, False, False]
    assert resp.candidates[0].address == "10.0.0.2:1" and resp.candidates[1].load.running == 5
    cold = reg.client.placement.LocateAdapter(pp.LocateAdapterRequest(adapter="cold@1"))
    assert [c.worker_id for c in cold.candidates] == [
        w["free"],
        w["idle-holder"],
        w["busy-holder"],
    ]  # default 3
    with pytest.raises(grpc.RpcError) as exc:
        reg.client.placement.LocateAdapter(pp.LocateAdapterRequest(adapter="missing"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    # the DB holds each placement
    workers = {x.worker_id: x for x in reg.client.workers()}
    assert [s.adapter for s in workers[w["idle-holder"]].slot_infos] == ["hot@1"]
    assert len(workers[w["full-busy"]].slot_infos) == 4


def test_lease_expiry_drops_placements_and_requires_reregistration(reg, adapter_dirs, tiny_shapes) -> None:
    reg.client.push(adapter_dirs["all-r4"], "hot", TINY_MODEL)
    alive, dying = _register(reg, "10.0.1.1:1", tiny_shapes), _register(reg, "10.0.1.2:1", tiny_shapes)
    _beat(reg, alive, ["hot@1"])
    _beat(reg, dying, ["hot@1"])
    for _ in range(3):  # keep one worker alive past the other's lease (2 s): 3.6 s of the registry's clock
        reg.clock.advance(1.2)
        _beat(reg, alive, ["hot@1"])
    assert reg.registry.placement.expire() == [dying]
    resp = reg.client.placement.LocateAdapter(pp.LocateAdapterRequest(adapter="hot", max_candidates=5))
    assert [c.worker_id for c in resp.candidates] == [alive]
    assert [x.worker_id for x in reg.client.workers()] == [alive]
    expired = {x.worker_id: x for x in reg.client.workers(include_expired=True)}
    assert expired[dying].state == pp.WORKER_STATE_EXPIRED and list(expired[dying].slot_infos) == []
    with pytest.raises(grpc.RpcError) as exc:
        _beat(reg, dying, ["hot@1"])
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    again = _register(reg, "10.0.1.2:1", tiny_shapes)  # same address: the old row is replaced
    assert again != dying
    assert sorted(x.worker_id for x in reg.client.workers(include_expired=True)) == sorted([alive, again])


def test_register_validation(reg, tiny_shapes) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        reg.client.placement.RegisterWorker(
            pp.RegisterWorkerRequest(address="", model_id=TINY_MODEL, slots=1)
        )
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for garbage, why in [
        ("10.0.2.9", "is neither HOST:PORT"),
        ("10.0.2.9:0", "the port must be a number from 1 to 65535"),
        ("<script>:80", "is no host name or IP address"),
        ("unix:relative.sock", "the socket path must be absolute"),
        ("unix:/run/with space.sock", "no whitespace or control character"),
    ]:
        with pytest.raises(grpc.RpcError) as exc:
            _register(reg, garbage, tiny_shapes)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.details().startswith(f"worker address {garbage!r}") and why in exc.value.details()
    _register(reg, "10.0.2.1:1", tiny_shapes)
    # a unix socket (a worker serving with --listen unix:PATH), recorded as unix:/absolute/path
    _register(reg, "unix:///run/loraserve/w.sock", tiny_shapes)
    _register(reg, "[fd00::7]:50061", tiny_shapes)
    listed = {w.address for w in reg.client.workers()}
    assert {"10.0.2.1:1", "unix:/run/loraserve/w.sock", "[fd00::7]:50061"} <= listed
    changed = {**tiny_shapes, "q_proj": (1, 2, 3)}
    with pytest.raises(grpc.RpcError) as exc:
        _register(reg, "10.0.2.2:1", changed)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_second_replica_sees_the_fleet_within_its_ttl(reg, adapter_dirs, tiny_shapes) -> None:
    """Locate ranks an in-memory view of the fleet: this replica's own writes show at once, another
    replica's (a second registry process on the same database) once its view is re-read (FLEET_TTL_S)."""
    from loraserve.registry.app import open_registry
    from loraserve.registry.placement import FLEET_TTL_S, ReportedLoad, SlotReport

    reg.client.push(adapter_dirs["all-r4"], "hot", TINY_MODEL)
    first = _register(reg, "10.0.3.1:1", tiny_shapes)
    reg.client.placement.LocateAdapter(pp.LocateAdapterRequest(adapter="hot"))  # reads the fleet
    # the second replica: same database, its own view, the same clock
    other = open_registry(reg.registry.config, reg.clock)
    try:
        assert [c.worker_id for c in other.placement.locate("hot")[1]] == [first]
        second = other.placement.register("10.0.3.2:1", TINY_MODEL, {}, 4)
        other.placement.heartbeat(second.id, [SlotReport(0, "hot@1", "LOADED")], ReportedLoad(free_slots=3))
        # the replica that took the heartbeat ranks the holder first at once
        key, ranked = other.placement.locate("hot")
        assert key == "hot@1" and [(c.worker_id, c.holds_adapter) for c in ranked] == [
            (second.id, True),
            (first, False),
        ]
        # the first replica has not re-read since ...
        stale = reg.client.placement.LocateAdapter(pp.LocateAdapterRequest(adapter="hot"))
        assert second.id not in [c.worker_id for c in stale.candidates]
        # ... and sees the holder once it does
        reg.clock.advance(FLEET_TTL_S + 0.1)
        fresh = reg.client.placement.LocateAdapter(pp.LocateAdapterRequest(adapter="hot"))
        assert [(c.worker_id, c.holds_adapter, c.tier) for c in fresh.candidates] == [
            (second.id, True, pp.RESIDENCY_TIER_DEVICE),
            (first, False, pp.RESIDENCY_TIER_UNSPECIFIED),
        ]
        # a lease that runs out drops out of the view without a re-read (the lease is 2 s here)
        other.placement.fleet.ttl_s = 3600.0
        other.placement.heartbeat(second.id, [SlotReport(0, "hot@1", "LOADED")], ReportedLoad(free_slots=3))
        assert [c.worker_id for c in other.placement.locate("hot")[1]] == [second.id, first]
        reg.clock.advance(2.2)
        assert other.placement.locate("hot")[1] == []
    finally:
        other.close()


def test_heartbeats_with_changed_usage_only_are_merged(reg, adapter_dirs, tiny_shapes) -> None:
    """A worker reports only the usage totals that changed since its last answered heartbeat
    (``usage_changed_only``): the registry merges them into what it holds for that worker, so an adapter
    left out keeps its totals; an older worker's full list (the flag unset) still replaces them."""
    for name in ("acct", "quiet"):
        reg.client.push(adapter_dirs["all-r4"], name, TINY_MODEL)
    wid = _register(reg, "10.0.4.1:1", tiny_shapes)

    def beat(changed_only: bool, **requests: int) -> None:
        usage = [
            pp.AdapterUsage(adapter=f"{k}@1", requests=n, prompt_tokens=10 * n) for k, n in requests.items()
        ]
        reg.client.placement.Heartbeat(
            pp.HeartbeatRequest(worker_id=wid, usage=usage, usage_changed_only=changed_only)
        )

    def requests(name: str) -> tuple[int, int]:
        u = reg.client.placement.GetAdapterStats(pp.GetAdapterStatsRequest(name=name)).versions[0].usage
        return u.requests, u.prompt_tokens

    beat(True, acct=3, quiet=5)
    beat(True, acct=4)  # quiet did not change: not sent, kept
    beat(True)
    assert requests("acct") == (4, 40) and requests("quiet") == (5, 50)
    beat(False, acct=7)  # a full report (older workers) replaces
    assert requests("acct") == (7, 70) and requests("quiet") == (0, 0)
