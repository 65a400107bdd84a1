"""Faults with real processes: kill -9 a worker mid-stream (its client gets UNAVAILABLE, the other
worker's stream completes, new requests are served, the dead worker's placements are cleaned up)."""

from __future__ import annotations

import pytest

from loraserve.client.registry_client import RegistryClient
from loraserve.client.sdk import Client
from loraserve.common.errors import LoraserveError
from loraserve.registry.config import RegistryConfig
from tests.e2e.procs import loraserve_process, wait_for_workers, wait_healthy
from tests.registry.conftest import start_registry

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_kill_9_a_worker_mid_stream(llama_dir, adapter_dirs, tmp_path) -> None:
    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"), lease_seconds=2)
    with start_registry(config, str(tmp_path / "s")) as reg:
        reg.client.push(adapter_dirs["all-r4"], "steady", "tiny")
        args = [
            "worker",
            "--model",
            str(llama_dir),
            "--model-id",
            "tiny",
            "--port",
            "0",
            "--registry",
            reg.address,
            "--max-seq-len",
            "512",
            "--max-loras",
            "2",
            "--max-batch-size",
            "2",
        ]
        with (
            # two workers warming up a 512-token context at once, beside another test process: allow time
            loraserve_process(args, timeout=300) as a,
            loraserve_process(args, timeout=300) as b,
            loraserve_process(
                ["router", "serve", "--port", "0", "--registry", reg.address, "--locate-ttl", "0.2"]
            ) as router,
        ):
            for w in (a, b):
                wait_healthy(w.address, timeout=180)
            wait_for_workers(reg.client, 2)
            long = dict(adapter="steady@1", max_tokens=480, ignore_eos=True)
            doomed = Client(a.address).generate([5], **long)
            survivor = Client(b.address).generate([5], **long)
            assert next(doomed).token_ids and next(survivor).token_ids  # both streams are running
            a.stop(kill=True)
            with pytest.raises(LoraserveError) as exc:
                for _ in doomed:
                    pass
            assert exc.value.code_name == "UNAVAILABLE"
            rest = list(survivor)
            assert rest[-1].finish_reason == "length" and rest[-1].completion_tokens == 480
            with Client(router.address) as client:  # requests that had not started are not lost
                outs = [client.complete([5, 6, 7], adapter="steady", max_tokens=3) for _ in range(6)]
            assert all(o.completion_tokens == 3 for o in outs)
            wait_for_workers(reg.client, 1)
            with RegistryClient(reg.address) as rc:
                workers = rc.workers()
            assert [w.address for w in workers] == [b.address]
            from sqlalchemy import select

            from loraserve.registry.db import PlacementRow, WorkerRow

            with reg.registry.catalog.sessions() as s:
                placed = (
                    s.execute(
                        select(WorkerRow.address).join(PlacementRow, PlacementRow.worker_id == WorkerRow.id)
                    )
                    .scalars()
                    .all()
                )
            assert set(placed) == {b.address}  # the dead worker holds nothing any more
