"""In-place updates (#17 item 3): a new version pushed under an alias while the old one decodes loads next to
it, new requests get it, the old request finishes on the version it started with, heartbeats show both, and
the old version is unloaded once it drains (a drain order from the registry, carried by a heartbeat).

Real registry, router, worker gRPC servers and registration on loopback; the worker's engine runs the fake
runner (arithmetic tokens, see engine/fake_runner.py) paced at a few ms a step, so a long request stays in
flight for seconds and its exact tokens are known. The registry-side rules (which versions an alias move
retires) are tested in tests/registry/test_aliases.py.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
from typing import Any

import grpc

from loraserve.client.sdk import Client
from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.engine.fake_runner import FakeRunner, next_token
from loraserve.models.checkpoint import read_config
from loraserve.models.config import ModelConfig
from loraserve.protos.v1 import worker_admin_pb2 as wa
from loraserve.protos.v1 import worker_admin_pb2_grpc
from loraserve.registry.config import RegistryConfig
from loraserve.router.routing import Locator, WorkerPool
from loraserve.router.server import build_server as build_router
from loraserve.worker.registration import Registration
from loraserve.worker.registry_source import RegistryAdapterSource
from loraserve.worker.server import build_server as build_worker
from tests.aio_thread import aio_server_thread
from tests.e2e.procs import wait_for_workers
from tests.registry.conftest import TINY_MODEL, start_registry
from tests.waiting import wait_until


class PacedRunner(FakeRunner):
    """The fake runner, a few milliseconds per decode step."""

    def decode(self, *args, **kwargs):
        time.sleep(0.004)
        return super().decode(*args, **kwargs)


def test_new_version_under_the_alias_loads_next_to_the_old_one_which_drains(
    llama_dir, adapter_dirs, tmp_path
) -> None:
    config = ModelConfig.from_hf(read_config(str(llama_dir)))
    engine_config = EngineConfig(max_batch_size=4, max_seq_len=4096, max_loras=4, max_lora_rank=16)
    with ExitStack() as es:
        registry = es.enter_context(
            start_registry(
                RegistryConfig(
                    db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"), lease_seconds=1
                ),
                str(tmp_path / "s"),
            )
        )
        reg = registry.client
        reg.push(adapter_dirs["all-r4"], "rl", TINY_MODEL)
        reg.set_alias("rl", "prod", [(1, 1)], "trainer")
        runner = PacedRunner.for_config(config.vocab_size, engine_config)
        engine = Engine(
            None,
            engine_config,
            RegistryAdapterSource(registry.address, cache_dir=str(tmp_path / "cache")),
            runner=runner,
            model_config=config,
        )
        engine.start()
        es.callback(engine.stop)
        side: dict[str, Any] = {}

        async def worker():
            server, port, _ = build_worker(engine, None, TINY_MODEL, "127.0.0.1:0")
            registration = side["registration"] = Registration(
                engine, registry.address, f"127.0.0.1:{port}", TINY_MODEL
            )
            side["task"] = asyncio.get_running_loop().create_task(registration.run())
            return server, port

        worker_address = f"127.0.0.1:{es.enter_context(aio_server_thread(worker))}"
        task = side["task"]
        es.callback(lambda: task.get_loop().call_soon_threadsafe(task.cancel))

        async def router():
            return build_router(
                Locator(registry.address, ttl=0.1, max_candidates=3), WorkerPool(), "127.0.0.1:0"
            )[:2]

        router_address = f"127.0.0.1:{es.enter_context(aio_server_thread(router))}"
        wait_for_workers(reg, 1)
        client = es.enter_context(Client(router_address))
        admin = worker_admin_pb2_grpc.WorkerAdminStub(es.enter_context(grpc.insecure_channel(worker_address)))

        def slots() -> dict[str, wa.SlotInfo]:
            listed = admin.ListSlots(wa.ListSlotsRequest(), timeout=5).slots
            return {s.adapter: s for s in listed if s.adapter}

        def placed() -> set[str]:  # what the registry last heard in a heartbeat
            return {s.adapter for w in reg.workers() for s in w.slot_infos}

        # A long request on rl@prod = v1 starts decoding.
        long = client.generate([5], adapter="rl@prod", max_tokens=3000, ignore_eos=True)
        first = next(long)
        assert first.adapter == "rl@1"
        v1_slot = slots()["rl@1"].slot
        received = list(first.token_ids)

        # The trainer pushes v2 and moves the alias in one step (what `push --alias prod` does).
        reg.push(adapter_dirs["mlp-r16"], "rl", TINY_MODEL)
        reg.set_alias("rl", "prod", [(2, 1)], "trainer")
        time.sleep(0.3)  # the router's locate cache (0.1 s) expires
        before = len(received)
        fresh = client.complete([5], adapter="rl@prod", max_tokens=3, ignore_eos=True)
        assert fresh.adapter == "rl@2"  # new requests get the new version ...
        received += [t for chunk in iter_some(long, 20) for t in chunk.token_ids]
        assert len(received) > before  # ... while the old request kept decoding
        wait_until(lambda: placed() == {"rl@1", "rl@2"}, "a heartbeat holding both")
        assert slots()["rl@1"].refcount == 1  # still in use: the drain order waits
        beats = side["registration"].heartbeats  # every 1/3 s, each answered with the drain order
        wait_until(lambda: side["registration"].heartbeats >= beats + 4, "four more heartbeats")
        assert "rl@1" in slots()  # the in-use slot stays

        # The old request finishes on v1 (its tokens are v1's slot arithmetic to the end), then v1 goes.
        rest = list(long)
        received += [t for c in rest for t in c.token_ids]
        assert rest[-1].adapter == "rl@1" and rest[-1].completion_tokens == 3000
        expected, last = [], 5
        for _ in range(3000):
            last = next_token(last, v1_slot, config.vocab_size)
            expected.append(last)
        assert received == expected
        wait_until(lambda: "rl@1" not in slots(), "v1 unloaded after draining")
        assert "rl@2" in slots()
        wait_until(lambda: placed() == {"rl@2"}, "the registry to see only v2")


def iter_some(stream, n: int):
    """The next ``n`` chunks of ``stream`` (fewer if it ends)."""
    for _ in range(n):
        try:
            yield next(stream)
        except StopIteration:
            return
