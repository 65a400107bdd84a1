"""Start loraserve servers as real processes (the same commands docker-compose runs) and stop them.

The launcher is ``loraserve.common.processes`` (the demo uses the same one).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
    """Run ``loraserve ARGS`` (pass ``--port 0``, or ``--listen unix:PATH``); waits for its 'serving on
    ADDRESS' line (``proc.address``: ``HOST:PORT`` or ``unix:/absolute/path``), stops it after."""
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


@contextmanager
def unix_socket_dir() -> Iterator[Path]:
    """A folder for unix-domain sockets, removed after: short, under /tmp, as a socket's path holds at most
    107 bytes (pytest's tmp_path, nested under the test's name, may not fit)."""
    folder = tempfile.mkdtemp(prefix="ls-", dir="/tmp" if os.path.isdir("/tmp") else None)
    try:
        yield Path(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    return inodes


INET_TABLES = ("tcp", "tcp6", "udp", "udp6", "udplite", "udplite6", "raw", "raw6")


def inet_sockets(pid: int) -> list[str]:
    """Every TCP, UDP and raw IP socket process ``pid`` holds open now, as ``table local-address`` (hex, as
    /proc writes it): its file descriptors' socket inodes that its network namespace's tables list."""
    inodes, found = _socket_inodes(pid), []
    for table in INET_TABLES:
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:  # a kernel without that protocol
            continue
        for cols in (line.split() for line in lines):
            if cols[9] in inodes:  # sl, local, remote, state, queues, timer, retransmits, uid, timeout, inode
                found.append(f"{table} {cols[1]}")
    return found


def unix_socket_paths(pid: int) -> set[str]:
    """The paths of the unix-domain sockets process ``pid`` holds that have one (listening ones, say)."""
    inodes, paths = _socket_inodes(pid), set()
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        cols = line.split()  # Num, RefCount, Protocol, Flags, Type, St, Inode[, Path]
        if len(cols) > 7 and cols[6] in inodes:
            paths.add(cols[7])
    return paths
