"""A worker (the FakeRunner's engine with a real tokenizer) and a router in front of it, each a process of its
own serving gRPC and the OpenAI HTTP API on one event loop, as ``loraserve worker``/``router`` do; and a health
prober process. The hostile-request tests measure the servers from outside: no GIL shared with the test.
Each of these processes raises its priority a little (nice -5) where it may, so that other work on a busy
machine (other tests, other users) counts less against the servers' health-check latency. To see what holds a
server's event loop, set ``LORASERVE_TEST_SLOW_CALLBACK=0.03``: asyncio's debug mode then logs (to the server's
output, ``Server.log``) every callback that ran longer.

    python -m tests.security.fake_servers worker TOKENIZER_DIR MAX_SEQ_LEN
    python -m tests.security.fake_servers router WORKER_ADDRESS
    python -m tests.security.fake_servers probe NAME HTTP_URL GRPC_ADDRESS [NAME HTTP_URL GRPC_ADDRESS ...]

Servers print ``loraserve <role> serving on HOST:PORT`` then ``loraserve http on http://HOST:PORT``. The prober
checks ``GET /health`` and gRPC ``Health.Check`` of every pair every 20 ms until its stdin closes, then prints
one JSON line ``{"NAME http"|"NAME grpc": [seconds, ...]}`` (a failed check counts as 10 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MODEL = "tiny-fake"
ADAPTERS = ("a1", "a2")
ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------- in the child
async def _serve_worker(tokenizer_dir: str, max_seq_len: int) -> None:
    from loraserve.common.security import ServerSecurity
    from loraserve.common.server import run_server
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.engine import Engine
    from loraserve.engine.fake_runner import FakeRunner
    from loraserve.httpapi import http_server
    from loraserve.worker.http_backend import WorkerHttpBackend
    from loraserve.worker.server import worker_services
    from loraserve.worker.tokenizer import load_tokenizer
    from tests.worker.fake_engine import TINY, source_of

    tokenizer = load_tokenizer(tokenizer_dir)
    model = dataclasses.replace(TINY, vocab_size=len(tokenizer), eos_token_ids=(tokenizer.eos_token_id,))
    config = EngineConfig(max_batch_size=4, max_seq_len=max_seq_len, max_loras=2, max_waiting=64)
    runner = FakeRunner.for_config(model.vocab_size, config)
    engine = Engine(None, config, source_of(*ADAPTERS), runner=runner, model_config=model)
    services = worker_services(engine, tokenizer, MODEL)
    http = http_server(WorkerHttpBackend(services.inference, MODEL), "127.0.0.1", 0, ServerSecurity())

    async def warmup() -> None:
        engine.start()

    await run_server(
        services,
        "127.0.0.1:0",
        ServerSecurity(),
        warmup=warmup,
        background=[http.run],
        cleanup=[engine.stop],
        grace=1.0,
    )


class FixedLocator:
    """The router's ``Locator`` for one worker: every adapter (and the base model) is routed there."""

    def __init__(self, address: str) -> None:
        from loraserve.common.security import aio_channel
        from loraserve.protos.v1 import placement_pb2_grpc

        self.address = address
        self.channel = aio_channel("127.0.0.1:1")  # no registry: /v1/models answers 503
        self.stub = placement_pb2_grpc.PlacementStub(self.channel)

    async def route(self, adapter: str, routing_key: str = ""):
        from loraserve.adapters.refs import parse_ref
        from loraserve.router.routing import Route

        if adapter:
            parse_ref(adapter)
        return Route(adapter, (self.address,), frozenset(), time.monotonic())

    def forget(self, adapter: str) -> None:
        pass


async def _serve_router(worker: str) -> None:
    from loraserve.common.security import ServerSecurity
    from loraserve.common.server import run_server
    from loraserve.httpapi import http_server
    from loraserve.router.http_backend import RouterHttpBackend
    from loraserve.router.routing import WorkerPool
    from loraserve.router.server import router_services

    locator = FixedLocator(worker)
    services = router_services(locator, WorkerPool(), max_concurrency=64)  # type: ignore[arg-type]
    backend = RouterHttpBackend(services.inference, locator)  # type: ignore[arg-type]
    backend._bases = (math.inf, {MODEL: 0})  # the live workers' models, never asked of a registry
    http = http_server(backend, "127.0.0.1", 0, ServerSecurity())
    await run_server(services, "127.0.0.1:0", ServerSecurity(), background=[http.run], grace=1.0)


def _probe(targets: list[tuple[str, str, str]]) -> None:
    import grpc
    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stop = threading.Event()
    seen: dict[str, list[float]] = {}

    def loop(name: str, url: str, address: str) -> None:
        with httpx.Client(timeout=10) as http, grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            checks = (
                (f"{name} http", lambda: http.get(f"{url}/health").raise_for_status()),
                (f"{name} grpc", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10)),
            )
            while not stop.is_set():
                for target, check in checks:
                    t = time.perf_counter()
                    try:
                        check()
                        took = time.perf_counter() - t
                    except Exception:
                        took = 10.0
                    seen.setdefault(target, []).append(took)
                stop.wait(0.02)

    threads = [threading.Thread(target=loop, args=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    print("probing", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    stop.set()
    for t in threads:
        t.join(15)
    print(json.dumps(seen), flush=True)


def main(argv: list[str]) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    with contextlib.suppress(OSError):  # where allowed: the machine's other work must not count as ours
        os.nice(-5)
    role, *args = argv
    slow = os.environ.get("LORASERVE_TEST_SLOW_CALLBACK")  # seconds: asyncio logs callbacks that take longer
    if slow and role != "probe":
        policy = asyncio.get_event_loop_policy()
        loop = policy.new_event_loop()
        loop.set_debug(True)
        loop.slow_callback_duration = float(slow)
        asyncio.set_event_loop(loop)
        run = loop.run_until_complete
    else:
        run = asyncio.run
    if role == "worker":
        run(_serve_worker(args[0], int(args[1])))
    elif role == "router":
        run(_serve_router(args[0]))
    elif role == "probe":
        _probe(list(zip(args[::3], args[1::3], args[2::3], strict=True)))
    else:
        raise SystemExit(f"unknown role {role!r}")


# ----------------------------------------------------------------------------------------------- in the test
@dataclasses.dataclass
class Server:
    role: str
    popen: subprocess.Popen
    address: str  # gRPC host:port
    url: str  # http://host:port
    log: list[str]

    def alive(self) -> bool:
        return self.popen.poll() is None


def _start(args: list[str], timeout: float = 120.0) -> Server:
    popen = subprocess.Popen(
        [sys.executable, "-m", "tests.security.fake_servers", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"},
    )
    log: list[str] = []
    ready = threading.Event()
    found: dict[str, str] = {}

    def read() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            log.append(line)
            if " serving on " in line:
                found["address"] = line.strip().rsplit(" ", 1)[-1]
            if line.startswith("loraserve http on "):
                found["url"] = line.strip().rsplit(" ", 1)[-1]
            if len(found) == 2:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(timeout)
    if len(found) != 2:
        popen.kill()
        raise RuntimeError(f"{args[0]} did not come up:\n{''.join(log[-40:])}")
    return Server(args[0], popen, found["address"], found["url"], log)


def _warm_up(servers: list[Server]) -> None:
    """One request of each kind through each server: what runs once per process (lazy imports, the chat
    template's compilation, the threads' start) is not measured against the hostile requests."""
    import grpc
    import httpx

    from loraserve.protos.v1 import inference_pb2 as pb
    from loraserve.protos.v1 import inference_pb2_grpc

    chat = [{"role": "user", "content": "hi"}]
    for s in servers:
        with httpx.Client(timeout=60) as http:
            for path, body in (
                ("completions", {"prompt": "hello", "logprobs": 2}),
                ("completions", {"prompt": [5, 6], "stream": True}),
                ("chat/completions", {"messages": chat, "stream": True}),
                ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
                ("completions", {"prompt": "x" * 100_000}),
            ):
                http.post(f"{s.url}/v1/{path}", json={"model": MODEL, "max_tokens": 2, **body})
            http.get(f"{s.url}/health")
        with grpc.insecure_channel(s.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for req in (
                pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=2)),
                pb.GenerateRequest(
                    chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
                ),
            ):
                list(stub.Generate(req, timeout=60))


@contextmanager
def fake_stack(tokenizer_dir: Path, max_seq_len: int) -> Iterator[tuple[Server, Server]]:
    """(worker, router) processes; both are stopped (SIGTERM, then SIGKILL) afterwards."""
    servers: list[Server] = []
    try:
        servers.append(_start(["worker", str(tokenizer_dir), str(max_seq_len)]))
        servers.append(_start(["router", servers[0].address]))
        _warm_up(servers)
        yield servers[0], servers[1]
    finally:
        for s in reversed(servers):
            s.popen.terminate()
            try:
                s.popen.wait(15)
            except subprocess.TimeoutExpired:
                s.popen.kill()
                s.popen.wait(15)


HEALTH_P99 = 0.1  # seconds: what health checks must stay under while hostile requests run


def health_limit(idle_p99: float) -> float:
    """The p99 health checks must stay under while a hostile request runs: ``HEALTH_P99``, or 3x what the same
    checks take on the idle servers when the machine itself is slower than that (CI runs two test processes on
    two cores). A loop blocked by a request stalls its checks for seconds: that fails either way."""
    return max(HEALTH_P99, 3 * idle_p99)


class Prober:
    """Health checks of ``servers`` from a process of its own while the ``with`` block runs;
    ``latencies`` (target -> seconds) once it is left. With ``baseline`` (the default), half a second of checks
    on the servers before the block (``idle_p99``) sets :meth:`limit`."""

    def __init__(self, *servers: Server, baseline: bool = True) -> None:
        self.servers, self.baseline = servers, baseline
        self.latencies: dict[str, list[float]] = {}
        self.idle_p99 = 0.0

    def limit(self) -> float:
        return health_limit(self.idle_p99)

    def __enter__(self) -> Prober:
        if self.baseline:
            with Prober(*self.servers, baseline=False) as idle:
                time.sleep(0.5)
            self.idle_p99 = max(idle.p99().values())
        args = [x for s in self.servers for x in (s.role, s.url, s.address)]
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.security.fake_servers", "probe", *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.popen.stdout is not None
        assert self.popen.stdout.readline().strip() == "probing"
        time.sleep(0.2)  # a few checks before the load starts
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.1)
        out, _ = self.popen.communicate(timeout=60)
        self.latencies = json.loads(out.strip().splitlines()[-1])

    def p99(self) -> dict[str, float]:
        """The 99th percentile latency of each target's checks, in seconds."""
        out = {}
        for name, xs in self.latencies.items():
            xs = sorted(xs)
            out[name] = xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]
        return out

    def assert_fast(self, limit: float | None = None) -> None:
        """Every target's p99 under ``limit`` (default :meth:`limit`)."""
        limit = self.limit() if limit is None else limit
        assert self.latencies and all(len(xs) >= 5 for xs in self.latencies.values()), self.latencies
        slow = {name: round(p, 4) for name, p in self.p99().items() if p >= limit}
        worst = {name: round(max(xs), 4) for name, xs in self.latencies.items()}
        assert not slow, (
            f"health checks over {limit * 1000:.0f} ms at p99: {slow} (max {worst}; idle p99 "
            f"{self.idle_p99 * 1000:.0f} ms)"
        )


def while_probing(servers: tuple[Server, ...], action, attempts: int = 3) -> Prober:
    """``action()`` while a prober checks the servers' health; their p99 must stay under 100 ms (or 3x the
    idle servers' p99 on a machine slower than that: ``fake_servers.health_limit``) in one of ``attempts``
    runs (a shared machine may starve any process for a moment; a loop blocked by the request fails every
    run)."""
    for _ in range(attempts):
        with Prober(*servers) as probe:
            action()
        print("health p99 (ms):", {k: round(v * 1000, 1) for k, v in probe.p99().items()})
        if all(p < probe.limit() for p in probe.p99().values()):
            return probe
    probe.assert_fast()
    return probe


if __name__ == "__main__":
    main(sys.argv[1:])
