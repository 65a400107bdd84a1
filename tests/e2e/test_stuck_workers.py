"""Stuck peers don't stick (#30 item 7): a worker that stops answering (SIGSTOP: its sockets stay open, the
kernel still acknowledges every byte, nothing comes back) never holds a router's stream.

Real processes on loopback: ``loraserve registry serve``, two fake-runner workers (``tests.e2e.fake_worker``:
A with more free slots, so the registry ranks it first) and ``loraserve router serve`` with 2-second
first-token and stall timeouts (``LORASERVE_ROUTER_WORKER_*``). Mid-stream, the client gets UNAVAILABLE
within the stall timeout; before the first token, the router gives up on A after the first-token timeout and
the client gets B's full answer. The client's own deadline (20 s) is far longer: without the router's
timeouts both would end in DEADLINE_EXCEEDED instead.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest

from loraserve.client.registry_client import RegistryClient
from loraserve.client.sdk import Client
from loraserve.common.errors import LoraserveError
from loraserve.common.processes import ServerProcess, start_server
from tests.e2e.fake_worker import fake_worker_process
from tests.e2e.procs import loraserve_process, wait_for_workers

pytestmark = pytest.mark.e2e

MODEL = "tiny-fake"
STALL = 2.0  # the router's first-token and stall timeouts in these tests
CLIENT_DEADLINE = 20.0


@dataclass
class Stack:
    a: ServerProcess  # ranked first (4 free slots)
    b: ServerProcess  # 2 free slots
    router: ServerProcess


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stuck")
    registry_env = {
        "LORASERVE_REGISTRY_DB": f"sqlite:///{tmp / 'r.db'}",
        "LORASERVE_REGISTRY_STORAGE": str(tmp / "store"),
        "LORASERVE_REGISTRY_LEASE_SECONDS": "30",  # a paused worker stays registered (and ranked first)
    }
    router_env = {
        "LORASERVE_ROUTER_WORKER_FIRST_TOKEN_TIMEOUT": str(STALL),
        "LORASERVE_ROUTER_WORKER_STALL_TIMEOUT": str(STALL),
    }
    with ExitStack() as es:
        registry = es.enter_context(loraserve_process(["registry", "serve", "--port", "0"], env=registry_env))
        router_args = [
            "router",
            "serve",
            "--port",
            "0",
            "--registry",
            registry.address,
            "--locate-ttl",
            "0.2",
        ]
        procs = [  # started together, then waited for
            fake_worker_process(registry.address, MODEL, max_loras=4, wait=False),
            fake_worker_process(registry.address, MODEL, max_loras=2, wait=False),
            start_server(router_args, router_env, timeout=None),
        ]
        for proc in procs:
            es.callback(proc.stop, kill=True)
        for proc in procs:
            proc.wait_ready(60)
        a, b, router = procs
        with RegistryClient(registry.address) as rc:
            assert len(wait_for_workers(rc, 2)) == 2
        yield Stack(a, b, router)


@contextmanager
def paused(proc: ServerProcess) -> Iterator[None]:
    os.kill(proc.popen.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.popen.pid, signal.SIGCONT)


def test_a_worker_paused_mid_stream_fails_the_stream_unavailable_within_the_stall_timeout(stack) -> None:
    with Client(stack.router.address, timeout=CLIENT_DEADLINE) as client:
        stream = client.generate([5], max_tokens=4000, ignore_eos=True)  # 40 s of decoding on A
        assert next(stream).token_ids
        with paused(stack.a):
            start = time.monotonic()
            with pytest.raises(LoraserveError) as err:
                for _ in stream:
                    pass
            elapsed = time.monotonic() - start
        assert err.value.code_name == "UNAVAILABLE", err.value.message
        assert stack.a.address in err.value.message and "sent nothing more" in err.value.message
        assert STALL - 0.5 < elapsed < STALL + 6, elapsed


def test_a_worker_paused_before_the_first_token_is_given_up_for_the_next(stack) -> None:
    prompt, kw = [5, 6, 7], dict(max_tokens=20, ignore_eos=True)
    with Client(stack.b.address) as direct:
        expected = direct.complete(prompt, **kw).token_ids
    with Client(stack.router.address, timeout=CLIENT_DEADLINE) as client, paused(stack.a):
        start = time.monotonic()
        out = client.complete(prompt, **kw)
        elapsed = time.monotonic() - start
    assert out.completion_tokens == 20 and out.token_ids == expected
    assert STALL - 0.5 < elapsed < STALL + 6, elapsed  # A was tried first, and given up after STALL
    with Client(stack.router.address, timeout=CLIENT_DEADLINE) as client:  # A serves again once resumed
        assert client.complete(prompt, **kw).completion_tokens == 20
