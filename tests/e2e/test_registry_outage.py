"""Registry down: a worker keeps serving the adapters it holds (directly and through the router's cached
route), then registers again when the registry returns on the same database."""

from __future__ import annotations

import time

import pytest

from loraserve.client.registry_client import RegistryClient
from loraserve.client.sdk import Client
from tests.conftest import with_test_xla_flags
from tests.e2e.compose_local import free_port
from tests.e2e.procs import COMPOSE_SHAPES, loraserve_process, wait_healthy, worker_args

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PROMPT = [5, 17, 33, 100, 7]


def test_worker_survives_a_registry_outage_and_registers_again(llama_dir, adapter_dirs, tmp_path) -> None:
    port = free_port()
    reg_args = [
        "registry",
        "serve",
        "--port",
        str(port),
        "--db",
        f"sqlite:///{tmp_path / 'r.db'}",
        "--storage",
        str(tmp_path / "store"),
        "--lease-seconds",
        "2",
    ]
    registry_address = f"127.0.0.1:{port}"
    with loraserve_process(reg_args) as registry:
        with RegistryClient(registry_address) as rc:
            rc.push(adapter_dirs["all-r4"], "steady", "tiny")
        # programs compile on first use: the outage, not the warm-up, is what is tested
        args = worker_args(llama_dir, registry_address, *COMPOSE_SHAPES, warmup=False)
        with (
            loraserve_process(args, env=with_test_xla_flags()) as worker,  # compile-bound
            loraserve_process(
                ["router", "serve", "--port", "0", "--registry", registry_address, "--locate-ttl", "0.5"]
            ) as router,
        ):
            wait_healthy(worker.address)
            with Client(router.address) as client:
                before = client.complete(PROMPT, adapter="steady", max_tokens=4, ignore_eos=True)
            assert before.adapter == "steady@1"
            with RegistryClient(registry_address) as rc:
                first_id = rc.workers()[0].worker_id
            assert registry.stop() == 0  # the registry goes away
            time.sleep(3)  # longer than the lease: nobody can renew anything now
            with Client(worker.address) as direct:
                assert (
                    direct.complete(PROMPT, adapter="steady@1", max_tokens=4, ignore_eos=True).token_ids
                    == before.token_ids
                )
            with Client(router.address) as client:  # the router keeps its last route for a known adapter
                assert (
                    client.complete(PROMPT, adapter="steady", max_tokens=4, ignore_eos=True).token_ids
                    == before.token_ids
                )
            with loraserve_process(reg_args):  # back, on the same database
                wait_healthy(registry_address)
                deadline = time.time() + 20
                workers = []
                while time.time() < deadline:
                    with RegistryClient(registry_address) as rc:
                        workers = rc.workers()
                    # registered again (a new id), then its first heartbeat reports the slots: RegisterWorker
                    # and that Heartbeat are two RPCs, and a poll can fall between them
                    if workers and workers[0].worker_id != first_id and workers[0].slot_infos:
                        break
                    time.sleep(0.2)
                assert [w.address for w in workers] == [worker.address] and workers[0].worker_id != first_id
                assert [s.adapter for s in workers[0].slot_infos] == ["steady@1"]
