"""Start loraserve servers as real processes (the same commands docker-compose runs) and stop them.

The launcher is ``loraserve.common.processes`` (the demo uses the same one).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve.common.processes import ServerProcess, start_server
from tests.waiting import settled


def wait_healthy(address: str, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.time() < deadline:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} did not become healthy")


@contextmanager
def loraserve_process(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 120.0
) -> Iterator[ServerProcess]:
    """Run ``loraserve ARGS`` (pass ``--port 0``); waits for its 'serving on HOST:PORT' line, stops it after."""
    proc = start_server(args, env, timeout=timeout)
    try:
        yield proc
    finally:
        proc.stop()


# docker-compose's worker shapes, which most end-to-end workers share: their programs come from the
# compilation cache the test run shares
COMPOSE_SHAPES = ("--max-seq-len", "64", "--max-loras", "2", "--max-lora-rank", "8")


def worker_args(model, registry: str, *extra: str, model_id: str = "tiny", warmup: bool = True) -> list[str]:
    """``loraserve worker`` arguments for a test model on a free port, registered with ``registry``, then
    ``extra``; ``warmup=False`` compiles each shape on first use (tests of something else than latency)."""
    args = ["worker", "--model", str(model), "--model-id", model_id, "--port", "0", "--registry", registry]
    return args + ([] if warmup else ["--warmup", "false"]) + list(extra)


def wait_for_workers(client, count: int, timeout: float = 20.0) -> list:
    """Poll ``client.workers()`` (a RegistryClient) until exactly ``count`` live workers are registered."""
    return settled(client.workers, lambda workers: len(workers) == count, timeout, interval=0.1)


def free_port_pair() -> int:
    """A port p with p + 1 free too (the coordinator and the leader's step channel)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports")
