"""A multi-host worker on one machine: two ``loraserve worker`` processes (leader and follower, two forced CPU
devices each) joined by ``jax.distributed`` over gloo into one tensor-parallel mesh of four, behind the router
and the registry. Every answer equals the same request on a one-device in-process engine, while adapters of
three ranks and a DoRA adapter are hot-swapped through two slots and a small KV pool preempts; nothing
compiles after warm-up on either process; stopping the leader stops the follower."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from loraserve.adapters.mixes import is_mix, parse_mix
from loraserve.client.sdk import Client
from loraserve.registry.config import RegistryConfig
from loraserve.worker.config import EngineConfig
from tests.conftest import with_test_xla_flags
from tests.e2e.procs import loraserve_process, wait_for_workers, wait_healthy, worker_args
from tests.e2e.reference import reference_tokens, versioned
from tests.registry.conftest import start_registry

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ADAPTERS = ("all-r4", "qv-r8-rslora", "mlp-r16", "dora-all-r4")
MIX = "all-r4*0.7+qv-r8-rslora*0.3"  # a weighted mix takes a slot of its own
SHAPES = dict(max_batch_size=4, max_seq_len=32, max_loras=2, max_lora_rank=16)
# 4 rows of up to 12 tokens need 4 pages of 4 each at their longest: 9 pages (one is the null page) preempt
KV = ("--kv-page-size", "4", "--kv-pages", "9")


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
