"""A tensor-parallel worker process (TP = 2 over two forced CPU devices) behind the router: every answer
equals the same request served by a single-device in-process engine; GetWorkerInfo and the registry's
worker record say 2."""

from __future__ import annotations

import grpc
import pytest

from loraserve.client.sdk import Client
from loraserve.engine.config import EngineConfig
from loraserve.protos.v1 import worker_admin_pb2, worker_admin_pb2_grpc
from loraserve.registry.config import RegistryConfig
from tests.conftest import with_test_xla_flags
from tests.e2e.procs import loraserve_process, wait_for_workers, wait_healthy, worker_args
from tests.e2e.reference import reference_tokens
from tests.registry.conftest import start_registry

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ADAPTERS = ("all-r4", "qv-r8-rslora", "mlp-r16")
# max_seq_len 16: the 4-token prompts and 6 new tokens fit, and the TP worker's warm-up and the reference
# engine compile one prefill bucket instead of three (16/32/64)
SHAPES = dict(max_batch_size=4, max_seq_len=16, max_loras=3, max_lora_rank=16)


def test_tp2_worker_behind_the_router(llama_dir, adapter_dirs, tmp_path) -> None:
    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"))
    with start_registry(config, str(tmp_path / "s")) as reg:
        for name in ADAPTERS:
            reg.client.push(adapter_dirs[name], name, "tiny")
        worker = worker_args(
            llama_dir, reg.address, "--tensor-parallel-size", "2", "--kernel-backend", "cpu", warmup=False
        )
        for key, value in SHAPES.items():
            worker += [f"--{key.replace('_', '-')}", str(value)]
        env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
        env = with_test_xla_flags(env)  # compile-bound: 8 requests of 6 tokens
        router = ["router", "serve", "--port", "0", "--registry", reg.address]
        with loraserve_process(worker, env=env, timeout=240) as w, loraserve_process(router) as r:
            wait_healthy(w.address, timeout=180)
            wait_healthy(r.address)
            (record,) = wait_for_workers(reg.client, 1)
            assert (record.address, record.tensor_parallel_size) == (w.address, 2)
            with grpc.insecure_channel(w.address) as channel:
                info = worker_admin_pb2_grpc.WorkerAdminStub(channel).GetWorkerInfo(
                    worker_admin_pb2.GetWorkerInfoRequest()
                )
            assert info.tensor_parallel_size == 2
            requests = [(([*ADAPTERS, ""])[i % 4], [5 + i, 17, 33, 100 + i]) for i in range(8)]
            with Client(r.address) as client:
                got = [client.complete(p, adapter=a, max_tokens=6, ignore_eos=True) for a, p in requests]
    want = reference_tokens(
        llama_dir, {n: adapter_dirs[n] for n in ADAPTERS}, requests, EngineConfig(**SHAPES)
    )
    for (adapter, _), out, tokens in zip(requests, got, want, strict=True):
        assert out.token_ids == tokens, adapter
        assert out.adapter == (f"{adapter}@1" if adapter else "")
