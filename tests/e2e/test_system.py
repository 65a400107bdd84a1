"""The whole system as processes, as docker-compose runs it: registry on PostgreSQL, adapters in GCS
(emulator, through gcsfs), two workers, the router. Every answer equals the same request served by a
single in-process engine; the database shows each placement; killing a worker loses no new request.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from sqlalchemy import create_engine, text

from loraserve.client.registry_client import RegistryClient
from loraserve.client.sdk import Client
from loraserve.common.errors import LoraserveError
from loraserve.common.security import channel
from loraserve.engine.config import EngineConfig
from loraserve.protos.v1 import worker_admin_pb2, worker_admin_pb2_grpc
from loraserve.registry.gcs_emulator import start_gcs_emulator
from tests.conftest import with_test_xla_flags
from tests.e2e.compose_local import TOKENS, LocalCompose
from tests.e2e.procs import wait_for_workers, wait_healthy
from tests.e2e.reference import reference_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.postgres, pytest.mark.gcs]
MODEL_ID = "demo-tiny-llama"


@pytest.fixture
def six_adapters(adapter_dirs, llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from loraserve.testing import make_adapter

    out = {f"e2e-{n}": adapter_dirs[n] for n in ("all-r4", "qv-r8-rslora", "attn-pattern")}
    for i, (r, targets) in enumerate(
        [(2, ("o_proj", "down_proj")), (8, ("q_proj", "up_proj")), (4, ("k_proj", "gate_proj"))]
    ):
        base = AutoModelForCausalLM.from_pretrained(str(llama_dir))
        make_adapter(base, tmp_path / f"extra{i}", r=r, alpha=8.0, targets=targets, seed=40 + i)
        out[f"e2e-extra{i}"] = tmp_path / f"extra{i}"
    return out


LEASE = 3  # seconds: the registry's worker lease in this test (docker-compose.yml: 6)


def test_compose_topology_as_processes(postgres_url, llama_dir, six_adapters, tmp_path) -> None:
    gcs = start_gcs_emulator("loraserve")
    stack = LocalCompose(
        db_url=postgres_url,
        gcs_endpoint=gcs.endpoint,
        model_dir=llama_dir,
        workdir=tmp_path,
        # compile-bound (72 requests of 6 tokens): the tests' XLA level; and a 3 s lease instead of compose's
        # 6 s (the same heartbeat every lease / 3, the same expiry, half the waiting for them)
        extra_env=with_test_xla_flags({"LORASERVE_REGISTRY_LEASE_SECONDS": str(LEASE)}),
    )
    procs = {}
    try:
        migrated = stack.run_job("migrate")
        assert migrated.returncode == 0, migrated.stderr
        procs["registry"] = stack.start("registry")
        wait_healthy(stack.address("registry"))
        registry = RegistryClient(stack.address("registry"), token=TOKENS["admin"])  # as the seed job
        for name, path in six_adapters.items():
            assert registry.push(path, name, MODEL_ID).uri.startswith("gs://loraserve/adapters/")
        # worker-1 warms up first: worker-2 then reads its programs from the compilation cache instead of
        # compiling the same ones beside it on the same cores
        procs["worker-1"] = stack.start("worker-1")
        wait_healthy(stack.address("worker-1"), timeout=180)
        for name in ("worker-2", "router"):
            procs[name] = stack.start(name)
        for name in ("worker-2", "router"):
            wait_healthy(stack.address(name), timeout=180)
        wait_for_workers(registry, 2, timeout=30)
        assert sorted(w.address for w in registry.workers()) == sorted(
            [stack.address("worker-1"), stack.address("worker-2")]
        )

        names = list(six_adapters)
        requests = [(names[i % 6], [5 + i % 7, 17, 33 + i % 3, 100, 7]) for i in range(60)]
        with (
            Client(stack.address("router"), token=TOKENS["inference"]) as client,
            ThreadPoolExecutor(60) as pool,
        ):
            results = list(
                pool.map(
                    lambda r: client.complete(r[1], adapter=r[0], max_tokens=6, ignore_eos=True), requests
                )
            )
        expected = reference_tokens(
            llama_dir,
            six_adapters,
            requests,
            EngineConfig(max_batch_size=8, max_seq_len=64, max_loras=6, max_lora_rank=8),
        )
        for (adapter, _), got, want in zip(requests, results, expected, strict=True):
            assert got.token_ids == want and got.adapter == f"{adapter}@1" and got.finish_reason == "length"

        # The router's OpenAI-compatible HTTP port (compose publishes it): the same tokens, and /v1/models
        # lists the workers' base model and every adapter in the registry.
        http = openai.OpenAI(
            base_url=f"{stack.http_url('router')}/v1", api_key=TOKENS["inference"], max_retries=0
        )
        for (adapter, prompt), got in list(zip(requests, results, strict=True))[:6]:
            out = http.completions.create(
                model=adapter, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
            )
            assert out.choices[0].text == got.text and out.usage.completion_tokens == 6
        assert [m.id for m in http.models.list()] == [MODEL_ID, *sorted(names)]

        time.sleep(LEASE / 3 + 0.5)  # one heartbeat (lease / 3): the DB now mirrors every worker's slots
        engine = create_engine(postgres_url)
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT w.address, p.adapter, p.state FROM placements p JOIN workers w ON w.id = p.worker_id"
                )
            ).all()
        engine.dispose()
        assert rows and all(state == "LOADED" for _, _, state in rows)
        assert {a for _, a, _ in rows} <= {f"{n}@1" for n in names}
        for name in ("worker-1", "worker-2"):  # the database holds exactly what each worker holds
            with channel(stack.address(name), token=TOKENS["worker-admin"]) as ch:
                slots = (
                    worker_admin_pb2_grpc.WorkerAdminStub(ch)
                    .ListSlots(worker_admin_pb2.ListSlotsRequest())
                    .slots
                )
            held = sorted(s.adapter for s in slots if s.adapter)
            assert held and sorted(a for addr, a, _ in rows if addr == stack.address(name)) == held, name

        # kill -9 one worker: requests keep flowing through the other, and its lease then expires
        procs.pop("worker-1").kill()
        with (
            Client(stack.address("router"), token=TOKENS["inference"]) as client,
            ThreadPoolExecutor(12) as pool,
        ):
            after = list(
                pool.map(
                    lambda r: client.complete(r[1], adapter=r[0], max_tokens=6, ignore_eos=True),
                    requests[:12],
                )
            )
        assert [r.token_ids for r in after] == expected[:12]
        wait_for_workers(registry, 1)
        assert [w.address for w in registry.workers()] == [stack.address("worker-2")]

        # delete means gone: one heartbeat after `adapters rm`, the version worker-2 holds is refused
        # there directly, through the router's gRPC and its HTTP port, and no slot holds it
        gone = f"{names[0]}@1"
        with Client(stack.address("worker-2"), token=TOKENS["worker-admin"]) as direct:  # an operator
            assert direct.complete([5, 17], adapter=gone, max_tokens=1).adapter == gone
        registry.delete(gone)
        time.sleep(2 * LEASE / 3 + 0.5)  # two heartbeats (lease / 3): the order came with one of them
        for address, token in (
            (stack.address("worker-2"), "worker-admin"),
            (stack.address("router"), "inference"),
        ):
            with Client(address, token=TOKENS[token]) as client, pytest.raises(LoraserveError) as exc:
                client.complete([5, 17], adapter=gone, max_tokens=1)
            assert exc.value.code_name == "NOT_FOUND", address
        with pytest.raises(openai.NotFoundError):
            http.completions.create(model=gone, prompt=[5, 17], max_tokens=1)
        with channel(stack.address("worker-2"), token=TOKENS["worker-admin"]) as ch:
            slots = worker_admin_pb2_grpc.WorkerAdminStub(ch).ListSlots(worker_admin_pb2.ListSlotsRequest())
        assert gone not in {s.adapter for s in slots.slots}
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)
        gcs.stop()
