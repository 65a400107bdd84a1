"""The worker-identity rule (docs/security.md): a RegisterWorker for an address held by a live lease is
refused unless it carries the same instance_id, so a holder of a worker token cannot take over a live
worker's address (and receive its users' prompts through the router). Real registry on loopback, tokens on, on
a manual clock: a lease ends when a test advances it past the lease."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from sqlalchemy import select

from loraserve.common.security import ServerSecurity, channel
from loraserve.protos.v1 import placement_pb2 as pp
from loraserve.protos.v1 import placement_pb2_grpc
from loraserve.registry.app import open_registry
from loraserve.registry.clock import ManualClock
from loraserve.registry.config import RegistryConfig
from loraserve.registry.db import WorkerRow
from loraserve.registry.server import build_server as build_registry
from tests.aio_thread import aio_server_thread
from tests.waiting import wait_until

ADMIN, WORKER, ROUTER = "admin-t", "worker-t", "router-t"
MODEL, ADDRESS, LEASE = "identity-model", "10.0.0.5:50051", 2


@pytest.fixture
def registry(tmp_path):
    reg = open_registry(
        RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"), lease_seconds=LEASE),
        ManualClock(),
    )
    security = ServerSecurity(admin_tokens=(ADMIN,), worker_tokens=(WORKER,), router_tokens=(ROUTER,))

    async def build():
        server, port, _ = build_registry(reg.catalog, reg.placement, "127.0.0.1:0", security)
        return server, port

    try:
        with aio_server_thread(build) as port:
            yield reg, f"127.0.0.1:{port}"
    finally:
        reg.close()


def _register(address: str, instance_id: str, token: str = WORKER) -> pp.RegisterWorkerResponse:
    with channel(address, token=token) as ch:
        return placement_pb2_grpc.PlacementStub(ch).RegisterWorker(
            pp.RegisterWorkerRequest(address=ADDRESS, model_id=MODEL, slots=2, instance_id=instance_id),
            timeout=5,
        )


def _locate(address: str) -> list[str]:
    with channel(address, token=ROUTER) as ch:
        resp = placement_pb2_grpc.PlacementStub(ch).LocateAdapter(pp.LocateAdapterRequest(), timeout=5)
    return [c.worker_id for c in resp.candidates]


def _rows(reg) -> list[tuple]:
    with reg.catalog.sessions() as s:
        return [
            (w.id, w.address, w.identity, w.state, w.lease_expires_at)
            for w in s.scalars(select(WorkerRow).order_by(WorkerRow.id))
        ]


def test_a_live_workers_address_cannot_be_taken_over(registry) -> None:
    reg, address = registry
    original = _register(address, "instance-of-the-real-worker").worker_id
    before = _rows(reg)
    assert [r[:2] for r in before] == [(original, ADDRESS)] and _locate(address) == [original]
    for thief in ("instance-of-the-attacker", ""):  # another identity, or none (a pre-identity client)
        with pytest.raises(grpc.RpcError) as exc:
            _register(address, thief)
        assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS, thief
        assert f"address {ADDRESS} is held by a live worker until " in exc.value.details()
        assert _rows(reg) == before  # the row is untouched: same id, identity and lease
        assert _locate(address) == [original]  # the router is still sent to the real worker
    # the same process again (a retry whose answer was lost, a re-registration): replaced at once
    again = _register(address, "instance-of-the-real-worker").worker_id
    assert again != original and _locate(address) == [again]


def test_another_identity_registers_once_the_lease_has_expired(registry) -> None:
    reg, address = registry
    first = _register(address, "first-process").worker_id
    with pytest.raises(grpc.RpcError) as exc:
        _register(address, "restarted-process")
    assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS
    reg.clock.advance(LEASE + 0.3)  # no heartbeat: the first lease ends
    second = _register(address, "restarted-process").worker_id
    assert second != first and [r[0] for r in _rows(reg)] == [second] and _locate(address) == [second]
    with pytest.raises(grpc.RpcError) as exc:  # and now the first process is the stranger
        _register(address, "first-process")
    assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_a_restarted_worker_process_registers_when_its_old_lease_ends(registry) -> None:
    """worker.registration: each Registration (process) has its own instance id; the second one, at the same
    address while the first heartbeats, is refused and retries, and registers once the first is gone."""
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.engine import Engine
    from loraserve.engine.fake_runner import FakeRunner
    from loraserve.worker.registration import Registration
    from tests.worker.fake_engine import TINY

    reg, address = registry
    cfg = EngineConfig(max_batch_size=2, max_seq_len=32, max_loras=2, max_lora_rank=4)

    def process() -> Registration:
        engine = Engine(
            None, cfg, None, runner=FakeRunner.for_config(TINY.vocab_size, cfg), model_config=TINY
        )
        return Registration(engine, address, ADDRESS, MODEL, token=WORKER)

    async def scenario() -> None:
        old, new = process(), process()
        assert old.instance_id != new.instance_id
        old_task = asyncio.create_task(old.run())
        await asyncio.wait_for(old.registered.wait(), 10)
        new_task = asyncio.create_task(new.run())

        async def next_heartbeat() -> None:  # the old process's, renewing its lease from the clock's now
            seen = old.heartbeats
            await asyncio.to_thread(wait_until, lambda: old.heartbeats > seen, "the old process's heartbeat")

        # the old one heartbeats: its lease stays live past its first one (LEASE + 0.5 s of the registry's
        # clock, less than a lease between two heartbeats), and the new one waits
        for step in (0.75 * LEASE, 0.25 * LEASE + 0.5):
            await next_heartbeat()
            reg.clock.advance(step)
        assert not new.registered.is_set() and old.heartbeats >= 2
        assert [r[0] for r in _rows(reg)] == [old.worker_id]
        old_task.cancel()  # the old process dies
        await asyncio.gather(old_task, return_exceptions=True)
        reg.clock.advance(LEASE + 0.1)  # and its last lease ends
        await asyncio.wait_for(new.registered.wait(), LEASE + 8)
        assert [r[0] for r in _rows(reg)] == [new.worker_id] and _locate(address) == [new.worker_id]
        new_task.cancel()
        await asyncio.gather(old_task, new_task, return_exceptions=True)

    asyncio.run(scenario())
