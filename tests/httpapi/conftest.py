"""A real worker (tiny Llama + two PEFT adapters) with its gRPC server and the OpenAI-compatible HTTP API."""

from __future__ import annotations

import openai
import pytest

from loraserve.engine.config import EngineConfig
from loraserve.httpapi.app import build_app
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.protos.v1 import inference_pb2_grpc
from loraserve.worker.http_backend import WorkerHttpBackend
from loraserve.worker.server import InferenceServicer
from tests.aio_thread import http_server_thread
from tests.worker.serving import running_worker

MODEL = "tiny-llama"


class Served:
    def __init__(self, worker, port: int) -> None:
        self.worker, self.port = worker, port
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def grpc(self, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        return list(inference_pb2_grpc.InferenceStub(self.worker.channel).Generate(req, timeout=60))


@pytest.fixture(scope="package")
def served(llama_dir, adapter_dirs):
    cfg = EngineConfig(max_batch_size=4, max_seq_len=512, max_loras=2, max_lora_rank=16)
    adapters = {"all-r4": adapter_dirs["all-r4"], "mlp-r16": adapter_dirs["mlp-r16"]}
    with running_worker(llama_dir, cfg, adapters, warmup=False) as w:  # 512 tokens: 6 prefill buckets

        def app():
            return build_app(WorkerHttpBackend(InferenceServicer(w.engine, w.tokenizer), MODEL))

        with http_server_thread(app) as port:
            yield Served(w, port)
