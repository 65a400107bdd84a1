"""A real worker (engine + grpc.aio server) on loopback, run on a background event loop for sync tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine
from loraserve.worker.server import build_server, set_serving
from loraserve.worker.tokenizer import load_tokenizer
from tests.aio_thread import aio_server_thread
from tests.engines import started_engine


@dataclass
class RunningWorker:
    address: str
    engine: Engine
    tokenizer: Any
    channel: grpc.Channel


@contextmanager
def running_worker(
    model_dir, config: EngineConfig, adapters: dict[str, Any] | None = None, warmup: bool = True
) -> Iterator[RunningWorker]:
    """A worker's gRPC server on loopback over a started engine; ``warmup=False`` compiles each shape when
    first run instead of every bucket at start (a fixture whose tests use a few shapes of a long context)."""
    tokenizer = load_tokenizer(str(model_dir))
    with started_engine(model_dir, config, adapters, warmup=warmup) as engine:

        async def build():
            server, port, health_servicer = build_server(engine, tokenizer, "tiny-llama", "127.0.0.1:0")
            await set_serving(health_servicer, True)
            return server, port

        with aio_server_thread(build) as port:
            address = f"127.0.0.1:{port}"
            with grpc.insecure_channel(address) as channel:
                yield RunningWorker(address, engine, tokenizer, channel)
