"""Every role on unix-domain sockets only (``--listen unix:PATH``), as on machines that allow no TCP at all: a
registry, a worker and a router as real processes, each serving on a socket file and dialling the others at
theirs, with default flags otherwise. An adapter pushed with the CLI answers a Generate through the router
(the same tokens as from the worker itself and as a one-device engine); the worker is registered at its
``unix:`` address, the registry's placement rows name it; a malformed address is refused; no process holds a
TCP or UDP socket; a router killed with SIGKILL restarts on the socket file it left; clean stops remove the
files."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import grpc
import pytest

from loraserve.client.registry_client import RegistryClient
from loraserve.client.sdk import Client
from loraserve.engine.config import EngineConfig
from loraserve.protos.v1 import placement_pb2 as pp
from loraserve.protos.v1 import placement_pb2_grpc
from tests.conftest import with_test_xla_flags
from tests.e2e.procs import (
    COMPOSE_SHAPES,
    inet_sockets,
    loraserve_process,
    unix_socket_dir,
    unix_socket_paths,
    wait_for_workers,
    worker_args,
)
from tests.e2e.reference import reference_tokens
from tests.waiting import settled

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL_ID = "unix-tiny"
PROMPT = [5, 17, 33, 100, 7]
TEXT = "What is the capital of France?"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loraserve", *args], capture_output=True, text=True, timeout=120
    )


def _generate(target: str) -> list[int]:
    """The tokens ``loraserve generate --target TARGET`` streams for TEXT with the pushed adapter."""
    out = _cli(
        *("generate", "--target", target, "--adapter", "over-unix"),
        *("--max-tokens", "6", "--ignore-eos", "--json", TEXT),
    )
    assert out.returncode == 0, out.stderr
    return [t for line in out.stdout.splitlines() for t in json.loads(line)["token_ids"]]


def _placements(db: str) -> list[tuple[str, str, str]]:
    with sqlite3.connect(db) as conn:
        query = "SELECT w.address, p.adapter, p.state FROM placements p JOIN workers w ON w.id = p.worker_id"
        return sorted(conn.execute(query).fetchall())


def test_every_role_over_unix_sockets_and_no_tcp(llama_dir, adapter_dirs, tmp_path) -> None:
    with unix_socket_dir() as sockets:
        registry_sock, worker_sock, router_sock = (
            sockets / f"{r}.sock" for r in ("registry", "worker", "router")
        )
        db = tmp_path / "r.db"
        registry_args = ["registry", "serve", "--listen", f"unix:{registry_sock}", "--db", f"sqlite:///{db}"]
        registry_args += ["--storage", str(tmp_path / "store"), "--lease-seconds", "3"]
        with loraserve_process(registry_args) as registry:
            assert registry.address == f"unix:{registry_sock}"
            push = _cli(
                *("adapters", "push", str(adapter_dirs["all-r4"]), "--name", "over-unix"),
                *("--base-model", MODEL_ID, "--registry", registry.address, "--json"),
            )
            assert push.returncode == 0, push.stderr
            assert json.loads(push.stdout)["version"] == 1

            args = worker_args(llama_dir, registry.address, *COMPOSE_SHAPES, model_id=MODEL_ID, warmup=False)
            args += ["--listen", f"unix:{worker_sock}"]  # replaces worker_args' --port 0
            with (
                loraserve_process(args, env=with_test_xla_flags()) as worker,  # compile-bound
                RegistryClient(registry.address) as reg,
            ):
                assert worker.address == f"unix:{worker_sock}"
                (registered,) = wait_for_workers(reg, 1)
                assert registered.address == worker.address  # what it advertises: its socket

                router_args = ["router", "serve", "--listen", f"unix:{router_sock}"]
                router_args += ["--registry", registry.address, "--locate-ttl", "0.2"]
                with loraserve_process(router_args) as router:
                    assert router.address == f"unix:{router_sock}"
                    with Client(router.address) as client:
                        routed = client.complete(PROMPT, adapter="over-unix", max_tokens=6, ignore_eos=True)
                    with Client(worker.address) as client:
                        direct = client.complete(PROMPT, adapter="over-unix", max_tokens=6, ignore_eos=True)
                        text = client.complete(TEXT, adapter="over-unix", max_tokens=6, ignore_eos=True)
                    (expected,) = reference_tokens(
                        llama_dir,
                        {"over-unix": adapter_dirs["all-r4"]},
                        [("over-unix", PROMPT)],
                        EngineConfig(max_batch_size=8, max_seq_len=64, max_loras=2, max_lora_rank=8),
                    )
                    assert routed.token_ids == direct.token_ids == expected
                    assert (routed.adapter, routed.finish_reason) == ("over-unix@1", "length")
                    assert _generate(router.address) == text.token_ids  # the CLI dials unix: too

                    # the registry's rows: the worker at its unix: address, holding the adapter it loaded
                    held = [(worker.address, "over-unix@1", "LOADED")]
                    assert settled(lambda: _placements(str(db)), held.__eq__, timeout=10) == held

                    # what other processes dial must be absolute and well formed; refused over the socket too
                    with grpc.insecure_channel(registry.address) as channel:
                        stub = placement_pb2_grpc.PlacementStub(channel)
                        for garbage in ("unix:worker.sock", "unix:/run/two words.sock", "worker"):
                            request = pp.RegisterWorkerRequest(address=garbage, model_id=MODEL_ID, slots=1)
                            with pytest.raises(grpc.RpcError) as exc:
                                stub.RegisterWorker(request, timeout=10)
                            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, garbage
                            assert exc.value.details().startswith(f"worker address {garbage!r}")

                    # default flags open no TCP or UDP socket (no metrics, HTTP or multi-host port), and the
                    # check sees each process's sockets: its own listening socket is among them
                    for proc, sock in (
                        (registry, registry_sock),
                        (worker, worker_sock),
                        (router, router_sock),
                    ):
                        assert inet_sockets(proc.popen.pid) == [], proc.popen.args
                        assert str(sock) in unix_socket_paths(proc.popen.pid)

                    router.kill()  # SIGKILL: nothing removes its socket file
                    assert router.wait(10) == -9 and router_sock.is_socket()
                with loraserve_process(router_args) as restarted:  # on the stale file: replaced
                    assert restarted.address == f"unix:{router_sock}"
                    with Client(restarted.address) as client:
                        again = client.complete(PROMPT, adapter="over-unix", max_tokens=6, ignore_eos=True)
                    assert again.token_ids == expected
                    assert restarted.stop() == 0
                assert not router_sock.exists()  # a clean stop removes the file
                assert worker.stop() == 0
            assert not worker_sock.exists()
            assert registry.stop() == 0
        assert not registry_sock.exists()
