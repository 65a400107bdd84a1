"""A multi-host worker on one machine: two ``loraserve worker`` processes (leader and follower, two forced CPU
devices each) joined by ``jax.distributed`` over gloo into one tensor-parallel mesh of four, behind the router
and the registry. Every answer equals the same request on a one-device in-process engine, while adapters of
three ranks and a DoRA adapter are hot-swapped through two slots and a small KV pool preempts; nothing
compiles after warm-up on either process; stopping the leader stops the follower."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve.adapters.mixes import is_mix, parse_mix
from loraserve.client.sdk import Client
from loraserve.common.processes import start_server
from loraserve.engine.config import EngineConfig
from loraserve.engine.multihost import EXIT_PEER_LOST
from loraserve.models.checkpoint import TensorFiles
from loraserve.registry.config import RegistryConfig
from tests.conftest import with_test_xla_flags
from tests.e2e.procs import free_port_pair, loraserve_process, wait_for_workers, wait_healthy, worker_args
from tests.e2e.reference import reference_tokens, versioned
from tests.registry.conftest import start_registry
from tests.waiting import settled

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ADAPTERS = ("all-r4", "qv-r8-rslora", "mlp-r16", "dora-all-r4")
MIX = "all-r4*0.7+qv-r8-rslora*0.3"  # a weighted mix takes a slot of its own
# max_seq_len 16: prompts of 4 and 8 new tokens fit, and warm-up compiles one prefill bucket, not two
SHAPES = dict(max_batch_size=4, max_seq_len=16, max_loras=2, max_lora_rank=16)
# 4 rows of up to 12 tokens need 3 pages of 4 each, 12 in all: 9 pages (one is the null page) preempt
KV = ("--kv-page-size", "4", "--kv-pages", "9")


def multihost_env() -> dict[str, str]:
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    env = with_test_xla_flags(env)
    env["JAX_LOG_COMPILES"] = "1"  # every compilation is logged: none may follow warm-up
    return env


def test_two_processes_serve_one_mesh(llama_dir, adapter_dirs, dora_dirs, tmp_path) -> None:
    dirs = {**{n: adapter_dirs[n] for n in ADAPTERS[:3]}, "dora-all-r4": dora_dirs("llama")["dora-all-r4"]}
    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"))
    port = free_port_pair()
    cluster = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--multihost-timeout", "120"]
    shapes = [x for k, v in SHAPES.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    flags = ["--tensor-parallel-size", "4", *shapes, *KV, *cluster]
    metrics = free_port_pair()
    with start_registry(config, str(tmp_path / "s")) as reg:
        for name, path in dirs.items():
            reg.client.push(path, name, "tiny")
        follower_log = tmp_path / "follower.log"
        follower = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loraserve",
                "worker",
                "--model",
                str(llama_dir),
                *flags,
                "--process-id",
                "1",
            ],
            env={**os.environ, **multihost_env()},
            stdout=subprocess.DEVNULL,
            stderr=follower_log.open("w"),
        )
        try:
            leader = worker_args(
                llama_dir, reg.address, *flags, "--process-id", "0", "--metrics-port", str(metrics)
            )
            router = ["router", "serve", "--port", "0", "--registry", reg.address]
            with (
                loraserve_process(leader, env=multihost_env(), timeout=300) as w,
                loraserve_process(router) as r,
            ):
                wait_healthy(w.address, timeout=240)
                wait_healthy(r.address)
                (record,) = wait_for_workers(reg.client, 1)
                assert record.tensor_parallel_size == 4
                served = _compiles(follower_log.read_text()), len(w.log)
                requests = [(([*ADAPTERS, MIX, ""])[i % 6], [5 + i, 17, 33, 100 + i]) for i in range(12)]
                with Client(r.address) as client, ThreadPoolExecutor(4) as pool, _logs(w, follower_log):
                    got = list(
                        pool.map(
                            lambda q: client.complete(q[1], max_tokens=8, ignore_eos=True, **_which(q[0])),
                            requests,
                        )
                    )
                after = w.log[served[1] :]
                scrape = (
                    urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
                )
            assert follower.wait(timeout=60) == 0  # the leader's stop stops it
        finally:
            if follower.poll() is None:
                follower.kill()
    assert float(re.search(r"^loraserve_preemptions(?:_total)? (\S+)$", scrape, re.M)[1]) > 0
    # each process read its devices' half of the checkpoint, and of the row-parallel o/down projections
    # whole rows (their halves of a row, 128 and 320 bytes apart, are closer than a page: read through);
    # the norms every device holds
    files = TensorFiles(str(llama_dir))
    whole = ("o_proj.weight", "down_proj.weight", "norm.weight")
    share = sum(
        s.itemsize * math.prod(s.shape) // (1 if name.endswith(whole) else 2)
        for name, s in files.tensors.items()
    )
    for text, k in (("".join(w.log), 0), (follower_log.read_text(), 1)):
        read = re.search(rf"read [\d.]+ MiB of its [\d.]+ MiB \((\d+)%; process {k} of 2\)", text)
        assert read and abs(int(read[1]) - 100 * share / files.total_bytes) <= 0.5, read
    assert served[0] > 0 and _compiles("".join(w.log[: served[1]])) > 0  # the count is live: warm-up compiled
    assert _compiles(follower_log.read_text()) == served[0], "the follower compiled while serving"
    assert _compiles("".join(after)) == 0, "the leader compiled while serving"
    want = reference_tokens(llama_dir, dirs, requests, EngineConfig(**SHAPES), max_tokens=8)
    for (adapter, _), out, tokens in zip(requests, got, want, strict=True):
        assert out.token_ids == tokens, adapter
        assert out.adapter == versioned(adapter)


def _which(adapter: str) -> dict:
    """The SDK's keyword for ``adapter``: a mix's parts as ``mix``, else ``adapter``."""
    if is_mix(adapter):
        return {"mix": [(p.ref, p.weight) for p in parse_mix(adapter)]}
    return {"adapter": adapter}


def _compiles(text: str) -> int:
    return len(re.findall(r"Compiling \w", text))


@contextmanager
def _logs(leader, follower_log):
    """On a failure, the tails of both processes' logs (pytest prints captured output of failed tests)."""
    try:
        yield
    except BaseException:
        print("--- leader\n" + "".join(leader.log[-60:]))
        print("--- follower\n" + "\n".join(follower_log.read_text().splitlines()[-60:]))
        raise


# ------------------------------------------------------------------------ failures: the group goes down


@contextmanager
def _group(llama_dir, tmp_path, timeout: float, tp: int = 4, ready: bool = True, leader_flags=()):
    """A leader and a follower of a small, unwarmed multi-host worker: ``(leader, follower, follower_log)``;
    with ``ready``, the leader is serving. ``leader_flags``: the leader's own (e.g. its registry)."""
    port = free_port_pair()
    flags = ["worker", "--model", str(llama_dir), "--tensor-parallel-size", str(tp), "--max-seq-len", "16"]
    flags += ["--max-batch-size", "2", "--max-loras", "1", "--max-lora-rank", "4", "--warmup", "false"]
    flags += [
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--multihost-timeout",
        str(timeout),
    ]
    follower_log = tmp_path / "follower.log"
    env = {**os.environ, **multihost_env(), "PYTHONUNBUFFERED": "1"}
    follower = subprocess.Popen(
        [sys.executable, "-m", "loraserve", *flags, "--process-id", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=follower_log.open("w"),
    )
    leader_args = [*flags, "--port", "0", "--process-id", "0", *leader_flags]
    leader = start_server(leader_args, multihost_env(), timeout=None)
    try:
        if ready:
            leader.wait_ready(180)
            wait_healthy(leader.address, timeout=60)
        yield leader, follower, follower_log
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
            p.wait(30)


def _health(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            status = (
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
            )
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def test_a_hung_follower_takes_the_group_down_and_the_router_fails_over(
    llama_dir, adapter_dirs, tmp_path
) -> None:
    """A SIGSTOPped follower: after --multihost-timeout the leader stops serving and exits 3 naming it; the
    registry drops the group and its placements when its lease lapses; the router sends the adapter's
    requests to the worker left."""
    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"), lease_seconds=2)
    with start_registry(config, str(tmp_path / "s")) as reg:
        reg.client.push(adapter_dirs["all-r4"], "steady", "tiny")
        registered = ("--registry", reg.address, "--model-id", "tiny")
        standby = ["worker", "--model", str(llama_dir), "--port", "0", "--warmup", "false", *registered]
        standby += [
            "--max-seq-len",
            "16",
            "--max-batch-size",
            "2",
            "--max-loras",
            "1",
            "--max-lora-rank",
            "4",
        ]
        router = ["router", "serve", "--port", "0", "--registry", reg.address, "--locate-ttl", "0.2"]
        with (
            _group(llama_dir, tmp_path, timeout=3, leader_flags=registered) as (leader, follower, _),
            loraserve_process(standby, env=with_test_xla_flags(), timeout=300) as other,
            loraserve_process(router) as r,
        ):
            wait_healthy(other.address, timeout=120)
            wait_for_workers(reg.client, 2)
            with Client(leader.address) as client:  # the group holds the adapter: a placement of its own
                assert client.complete([5, 17], adapter="steady", max_tokens=2).adapter == "steady@1"
            settled(lambda: _placed(reg), lambda placed: leader.address in placed, timeout=20, interval=0.1)
            follower.send_signal(signal.SIGSTOP)  # hung: alive, silent
            stopped = time.monotonic()
            seen = settled(
                lambda: _health(leader.address), lambda s: s != "SERVING", timeout=30, interval=0.1
            )
            noticed = time.monotonic() - stopped
            code = leader.wait(timeout=30)
            log = "".join(leader.log)
            (left,) = wait_for_workers(reg.client, 1)
            with Client(r.address) as client:
                outs = [client.complete([5, 6, 7], adapter="steady", max_tokens=2) for _ in range(3)]
            # the group's placement is gone and the worker left holds the adapter (its next heartbeat)
            placed = settled(lambda: _placed(reg), lambda placed: placed == {other.address}, timeout=20)
    # the timeout (less the up to timeout / 4 since its last ping), not at once
    # NOT_SERVING while it drains; then the server stops (a check in flight is cancelled, later ones fail)
    assert seen in ("NOT_SERVING", "CANCELLED", "UNAVAILABLE") and 2.0 < noticed < 15
    assert code == EXIT_PEER_LOST
    assert re.search(r"process 1 \(127\.0\.0\.1\) sent nothing for \d+\.\d s", log), log[-2000:]
    assert left.address == other.address and placed == {other.address}
    assert [o.adapter for o in outs] == ["steady@1"] * 3


def _placed(reg) -> set[str]:
    """The addresses of the workers the registry's database records placements for."""
    from sqlalchemy import select

    from loraserve.registry.db import PlacementRow, WorkerRow

    with reg.registry.catalog.sessions() as s:
        rows = s.execute(select(WorkerRow.address).join(PlacementRow, PlacementRow.worker_id == WorkerRow.id))
        return set(rows.scalars().all())


def test_a_dead_leader_takes_the_followers_down(llama_dir, tmp_path) -> None:
    with _group(llama_dir, tmp_path, timeout=60) as (leader, follower, follower_log):
        leader.kill()
        killed = time.monotonic()
        code = follower.wait(timeout=30)
        took = time.monotonic() - killed
    assert code == EXIT_PEER_LOST and took < 10  # the broken connection, not the 60 s timeout
    assert "the leader left the step channel" in follower_log.read_text()


def test_devices_that_do_not_make_the_mesh_are_refused_on_every_process(llama_dir, tmp_path) -> None:
    with _group(llama_dir, tmp_path, timeout=60, tp=2, ready=False) as (leader, follower, follower_log):
        codes = leader.wait(timeout=120), follower.wait(timeout=60)
        log = "".join(leader.log)
    want = "FAILED_PRECONDITION: tensor_parallel_size 2 must span all 4 devices of the 2 processes (2 each)"
    assert codes == (1, 1) and want in log and want in follower_log.read_text()
