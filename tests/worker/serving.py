"""A real worker (engine + grpc.aio server) on loopback, run on a background event loop for sync tests.

On a TPU host (no TCP or UDP sockets there, loopback included) it listens on a unix-domain socket instead."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.worker.server import build_server, set_serving
from loraserve.worker.tokenizer import load_tokenizer
from tests.aio_thread import aio_server_thread
from tests.engines import started_engine
from tests.platform import ON_TPU


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
    with (
        started_engine(model_dir, config, adapters, warmup=warmup) as engine,
        tempfile.TemporaryDirectory() as tmp,
    ):
        listen = f"unix:{Path(tmp) / 'worker.sock'}" if ON_TPU else "127.0.0.1:0"

        async def build():
            server, port, health_servicer = build_server(engine, tokenizer, "tiny-llama", listen)
            await set_serving(health_servicer, True)
            return server, port

        with aio_server_thread(build) as port:
            address = listen if ON_TPU else f"127.0.0.1:{port}"
            with grpc.insecure_channel(address) as channel:
                yield RunningWorker(address, engine, tokenizer, channel)
