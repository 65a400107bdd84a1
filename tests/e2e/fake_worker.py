"""A worker process on the FakeRunner (no JAX, no checkpoint, up in about a second): served on loopback,
registered with a registry and heartbeating, as ``loraserve worker --registry`` is. For process tests that
stop, pause or kill a worker. It serves the base model only (no adapters); its tokens are the fake runner's
arithmetic, one decode step every STEP_SECONDS.

    python -m tests.e2e.fake_worker REGISTRY_ADDRESS MODEL_ID MAX_LORAS [STEP_SECONDS]

It prints ``loraserve worker serving on HOST:PORT`` once it serves (``common.processes`` waits for that line).
MAX_LORAS sets its free slots, which the registry ranks by: the worker with more goes first.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from loraserve.common.processes import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


def fake_worker_process(
    registry: str, model_id: str, max_loras: int, step_seconds: float = 0.01, wait: bool = True
) -> ServerProcess:
    """Start one (``.stop()`` it after) and, with ``wait``, wait for its ready line (else call ``wait_ready``);
    ``.address`` is where it serves."""
    popen = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.e2e.fake_worker",
            registry,
            model_id,
            str(max_loras),
            str(step_seconds),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    proc = ServerProcess(popen)
    if wait:
        proc.wait_ready(60)
    return proc


async def _serve(registry: str, model_id: str, max_loras: int, step_seconds: float) -> None:
    from loraserve.adapters.sources import LocalAdapterSource
    from loraserve.common.security import ServerSecurity
    from loraserve.common.server import run_server
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.engine import Engine
    from loraserve.engine.fake_runner import FakeRunner
    from loraserve.worker.registration import Registration
    from loraserve.worker.server import worker_services
    from tests.worker.fake_engine import TINY

    class PacedRunner(FakeRunner):
        def decode(self, *args, **kwargs):
            time.sleep(step_seconds)
            return super().decode(*args, **kwargs)

    config = EngineConfig(max_batch_size=4, max_seq_len=4096, max_loras=max_loras, max_waiting=64)
    runner = PacedRunner.for_config(TINY.vocab_size, config)
    engine = Engine(None, config, LocalAdapterSource(), runner=runner, model_config=TINY)
    services = worker_services(engine, None, model_id)

    async def warmup() -> None:
        engine.start()

    def register(address: str):
        return Registration(engine, registry, address, model_id).run()

    await run_server(
        services,
        "127.0.0.1:0",
        ServerSecurity(),
        warmup=warmup,
        background=[register],
        cleanup=[engine.stop],
        grace=1.0,
    )


def main(argv: Sequence[str]) -> None:
    registry, model_id, max_loras = argv[0], argv[1], int(argv[2])
    step = float(argv[3]) if len(argv) > 3 else 0.01
    asyncio.run(_serve(registry, model_id, max_loras, step))


if __name__ == "__main__":
    main(sys.argv[1:])
