"""A real worker (engine + grpc.aio server) on loopback, run on a background event loop for sync tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from worker.checkpoint import load_checkpoint
from worker.config import EngineConfig
from worker.engine import Engine
from worker.server import build_server, set_serving
from worker.sources import LocalAdapterSource
from worker.tokenizer import load_tokenizer


@dataclass
class RunningWorker:
    address: str
    engine: Engine
    tokenizer: Any
    channel: grpc.Channel


@contextmanager
def running_worker(
    model_dir, config: EngineConfig, adapters: dict[str, Any] | None = None
) -> Iterator[RunningWorker]:
    source = LocalAdapterSource()
    for name, path in (adapters or {}).items():
        source.register(name, str(path))
    engine = Engine(load_checkpoint(str(model_dir)), config, source=source)
    tokenizer = load_tokenizer(str(model_dir))
    engine.start()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        server, port, health_servicer = build_server(engine, tokenizer, "tiny-llama", "127.0.0.1:0")
        await server.start()
        await set_serving(health_servicer, True)
        holder.update(server=server, port=port, stop=asyncio.Event())
        started.set()
        await holder["stop"].wait()
        await server.stop(grace=1)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(30)
    address = f"127.0.0.1:{holder['port']}"
    channel = grpc.insecure_channel(address)
    try:
        yield RunningWorker(address, engine, tokenizer, channel)
    finally:
        channel.close()
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(10)
        engine.stop()
