"""Start loraserve servers as real processes (the same commands docker-compose runs) and stop them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass
class Proc:
    popen: subprocess.Popen
    address: str
    log: list[str]

    def stop(self, sig_kill: bool = False) -> int:
        if self.popen.poll() is None:
            (self.popen.kill if sig_kill else self.popen.terminate)()
        return self.popen.wait(30)


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
) -> Iterator[Proc]:
    """Run ``loraserve ARGS`` with ``--port 0``; waits for its 'serving on HOST:PORT' line."""
    cmd = [sys.executable, "-m", "loraserve", *args]
    popen = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
    )
    log: list[str] = []
    address = ""
    deadline = time.time() + timeout
    assert popen.stdout is not None
    while time.time() < deadline:
        line = popen.stdout.readline()
        if not line:
            break
        log.append(line)
        if "serving on" in line:
            address = line.strip().rsplit(" ", 1)[-1]
            break
    if not address:
        popen.kill()
        raise RuntimeError(f"{' '.join(args)} did not start:\n{''.join(log[-40:])}")
    import threading

    threading.Thread(target=lambda: log.extend(popen.stdout), daemon=True).start()  # keep draining the pipe
    proc = Proc(popen, address, log)
    try:
        yield proc
    finally:
        proc.stop()


def wait_for_workers(client, count: int, timeout: float = 20.0) -> list:
    """Poll ``client.workers()`` (a RegistryClient) until exactly ``count`` live workers are registered."""
    deadline = time.time() + timeout
    workers = client.workers()
    while len(workers) != count and time.time() < deadline:
        time.sleep(0.1)
        workers = client.workers()
    return workers
