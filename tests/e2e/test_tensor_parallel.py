"""A tensor-parallel worker process (TP = 2 over two forced CPU devices) behind the router: every answer
equals the same request served by a single-device in-process engine; GetWorkerInfo and the registry's
worker record say 2."""

from __future__ import annotations

import time
import uuid

import grpc
import pytest

from loraserve.adapters.sources import LocalAdapterSource
from loraserve.client.sdk import Client
from loraserve.protos.v1 import worker_admin_pb2, worker_admin_pb2_grpc
from loraserve.registry.config import RegistryConfig
from loraserve.worker.checkpoint import load_checkpoint
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine
from loraserve.worker.requests import EngineRequest, Failed, Finished, Sampling, Token
from tests.e2e.procs import loraserve_process, wait_for_workers, wait_healthy
from tests.registry.conftest import start_registry

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ADAPTERS = ("all-r4", "qv-r8-rslora", "mlp-r16")
SHAPES = dict(max_batch_size=4, max_seq_len=64, max_loras=3, max_lora_rank=16)


def _reference(llama_dir, adapter_dirs, requests) -> list[list[int]]:
    """The same requests on a one-device engine in this process."""
    src = LocalAdapterSource()
    for name in ADAPTERS:
        src.register(f"{name}@1", str(adapter_dirs[name]))
    engine = Engine(load_checkpoint(str(llama_dir)), EngineConfig(**SHAPES), source=src)
    engine.start()
    try:
        outs = []
        for adapter, prompt in requests:
            got, done = [], []

            def collect(event, got=got, done=done) -> None:
                if isinstance(event, Token):
                    got.append(event.token_id)
                elif isinstance(event, Finished | Failed):
                    done.append(event)

            req_adapter = f"{adapter}@1" if adapter else ""
            sampling = Sampling(max_tokens=6, ignore_eos=True)
            engine.submit(EngineRequest(uuid.uuid4().hex, req_adapter, prompt, sampling, collect))
            deadline = time.time() + 60
            while not done and time.time() < deadline:
                time.sleep(0.005)
            assert isinstance(done[0], Finished), done
            outs.append([*got, done[0].token_id])
        return outs
    finally:
        engine.stop()


def test_tp2_worker_behind_the_router(llama_dir, adapter_dirs, tmp_path) -> None:
    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"))
    with start_registry(config, str(tmp_path / "s")) as reg:
        for name in ADAPTERS:
            reg.client.push(adapter_dirs[name], name, "tiny")
        worker = ["worker", "--model", str(llama_dir), "--model-id", "tiny", "--port", "0"]
        worker += ["--registry", reg.address, "--tensor-parallel-size", "2", "--kernel-backend", "cpu"]
        for key, value in SHAPES.items():
            worker += [f"--{key.replace('_', '-')}", str(value)]
        env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
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
    want = _reference(llama_dir, adapter_dirs, requests)
    for (adapter, _), out, tokens in zip(requests, got, want, strict=True):
        assert out.token_ids == tokens, adapter
        assert out.adapter == (f"{adapter}@1" if adapter else "")
