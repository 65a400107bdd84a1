"""A client that leaves costs nothing (#57): 100 streams dropped mid-way through the router while other requests
run. HTTP ``/v1/completions`` streams with n=1 and n=2 (one upstream ``Generate`` per choice) and gRPC
``Generate`` streams, each dropped after its first chunk, plus HTTP requests left before their (non-streamed)
answer. Then, from the worker's Prometheus counters:

- every upstream request was cancelled at the worker for its client (``loraserve_requests_cancelled_total``
  ``{reason="client"}`` rose by exactly that many; the router cancelled each call: the worker's ``Generate``
  RPCs that ended ``CANCELLED``);
- none took more than 2 tokens after its cancel was posted to the engine (``loraserve_tokens_after_cancel``: the
  step running when the cancel arrives gives a request at most its prefill's token and one decode token, or,
  with the worker's async decode, one token and the step dispatched before, which the cancel reads first);
- rows, queue and KV pages in use are back to 0 and no adapter slot is still referenced;
- the router and the worker logged nothing at ERROR and no traceback (a client leaving is no server error),
while the requests that stayed all finished.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraserve.client.sdk import Client
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.protos.v1 import inference_pb2_grpc, worker_admin_pb2, worker_admin_pb2_grpc
from loraserve.registry.config import RegistryConfig
from tests.conftest import with_test_xla_flags
from tests.e2e.compose_local import free_port
from tests.e2e.procs import loraserve_process, wait_for_workers, wait_healthy, worker_args
from tests.registry.conftest import start_registry
from tests.waiting import settled

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STREAMS = 100  # dropped after their first chunk: HTTP n=1, HTTP n=2 and gRPC in turn
LEFT = 6  # non-streamed HTTP requests left before their answer (n=1 and n=2 in turn)
AT_ONCE = 16  # drops in flight together
MAX_TOKENS = 500  # far more than a request decodes before its client leaves: each is still running then
AFTER_CANCEL_BOUND = 2  # tokens a request may take after its cancel is posted (see the module's docstring)
PROMPT = [5, 17, 33, 100, 7, 42]
ADAPTERS = ("all-r4", "mlp-r16")
# what no client's leaving may log: Python's ERROR and CRITICAL lines, tracebacks, gRPC core's errors
LOUD = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback|^E\d{4} ")
MODELS = ("tiny", *ADAPTERS)  # the base model's id, then the adapters


def _plan(i: int) -> tuple[str, str, int]:
    """Drop ``i``'s (kind, model, upstream requests): streams HTTP n=1, HTTP n=2 and gRPC in turn, then the
    non-streamed HTTP requests left, n=1 and n=2 in turn."""
    model = MODELS[i % len(MODELS)]
    if i >= STREAMS:
        return "http left", model, 1 + i % 2
    return ("http stream", "http stream", "grpc")[i % 3], model, (1, 2, 1)[i % 3]


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _http_request(port: int, body: dict) -> socket.socket:
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    )
    sock.sendall(head.encode() + raw)
    return sock


def _drop_http_stream(port: int, model: str, n: int) -> None:
    """A streamed completion read up to its first SSE event, then the connection closed."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    with _http_request(port, {**body, "n": n}) as sock:
        got = b""
        while b"\ndata: " not in got:
            part = sock.recv(4096)
            assert part, f"the stream ended before its first event: {got[:300]!r}"
            got += part
        assert got.startswith(b"HTTP/1.1 200"), got[:300]
        sock.shutdown(socket.SHUT_RDWR)


def _leave_http(port: int, model: str, n: int) -> None:
    """A non-streamed completion whose client leaves while it is generated (the server polls for that)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": n}
    with _http_request(port, body) as sock:
        time.sleep(0.3)
        sock.shutdown(socket.SHUT_RDWR)


def _drop_grpc_stream(stub: inference_pb2_grpc.InferenceStub, adapter: str) -> None:
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    call = stub.Generate(
        pb.GenerateRequest(adapter=adapter, tokens=pb.TokenIds(ids=PROMPT), sampling=sampling), timeout=60
    )
    first = next(call)
    assert first.request_id
    call.cancel()


def test_100_streams_dropped_under_load_cost_the_worker_one_step_each(
    llama_dir, adapter_dirs, tmp_path
) -> None:
    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"), lease_seconds=3)
    with start_registry(config, str(tmp_path / "s")) as reg:
        for name in ADAPTERS:
            reg.client.push(adapter_dirs[name], name, "tiny")
        ports = {n: free_port() for n in ("worker", "router", "http")}
        # prompt + MAX_TOKENS fit 512; 16 rows: the drops queue for rows as much as they run
        shapes = ("--max-seq-len", "512", "--max-loras", "2", "--max-batch-size", "16")
        worker = worker_args(
            llama_dir, reg.address, *shapes, "--metrics-port", str(ports["worker"]), warmup=False
        )
        router_args = ["router", "serve", "--port", "0", "--registry", reg.address]
        router_args += ["--http-port", str(ports["http"]), "--metrics-port", str(ports["router"])]
        with (
            # no warm-up: the requests below compile what the drops run, at the tests' XLA level
            loraserve_process(worker, env=with_test_xla_flags()) as w,
            loraserve_process(router_args) as router,
        ):
            wait_healthy(w.address, timeout=180)
            wait_for_workers(reg.client, 1)
            channel = grpc.insecure_channel(router.address)
            stub = inference_pb2_grpc.InferenceStub(channel)
            # every model to its end, and one n=2 stream dropped: what the drops run is compiled before they start
            with Client(router.address, timeout=60) as client:
                for adapter in ("", *ADAPTERS):
                    assert client.complete(PROMPT, adapter=adapter, max_tokens=2).completion_tokens == 2
            _drop_http_stream(ports["http"], "all-r4", 2)
            settled(lambda: _scrape(ports["worker"]), lambda s: _value(s, "loraserve_requests_running") == 0)
            before = _scrape(ports["worker"])
            router_before = _scrape(ports["router"])

            # the load: requests that stay, to their end, all the while
            stop, lock, outcomes = threading.Event(), threading.Lock(), Counter()

            def stay(seed: int) -> None:
                with Client(router.address, timeout=60) as client:
                    while not stop.is_set():
                        out = client.complete(
                            PROMPT, adapter=ADAPTERS[seed % 2], max_tokens=8, ignore_eos=True
                        )
                        with lock:
                            outcomes["OK" if out.completion_tokens == 8 else "WRONG_LENGTH"] += 1

            staying = [threading.Thread(target=stay, args=(i,)) for i in range(4)]
            for t in staying:
                t.start()

            def drop(i: int) -> None:
                kind, model, n = _plan(i)
                if kind == "grpc":
                    _drop_grpc_stream(stub, "" if model == "tiny" else model)
                elif kind == "http stream":
                    _drop_http_stream(ports["http"], model, n)
                else:
                    _leave_http(ports["http"], model, n)

            started = time.monotonic()
            with ThreadPoolExecutor(AT_ONCE) as pool:
                list(pool.map(drop, range(STREAMS + LEFT)))
            dropped_at = time.monotonic()
            stop.set()
            for t in staying:
                t.join(60)
            upstream = Counter()  # upstream Generate calls dropped, by kind (an HTTP request: one per choice)
            for kind, _, n in map(_plan, range(STREAMS + LEFT)):
                upstream[kind] += n
            dropped = sum(upstream.values())

            def quiet(s: dict) -> bool:
                return (
                    _value(s, "loraserve_requests_cancelled_total", reason="client")
                    - _value(before, "loraserve_requests_cancelled_total", reason="client")
                    >= dropped
                    and _value(s, "loraserve_requests_running") == 0
                    and _value(s, "loraserve_requests_waiting") == 0
                    and _value(s, "loraserve_kv_cache_pages_used") == 0
                )

            after = settled(lambda: _scrape(ports["worker"]), quiet, timeout=15)
            settled_in = time.monotonic() - dropped_at
            router_after = _scrape(ports["router"])
            with grpc.insecure_channel(w.address) as admin_channel:
                slots = worker_admin_pb2_grpc.WorkerAdminStub(admin_channel).ListSlots(
                    worker_admin_pb2.ListSlotsRequest(), timeout=10
                )
            channel.close()

        def delta(name: str, old: dict = before, new: dict = after, **labels: str) -> float:
            return _value(new, name, **labels) - _value(old, name, **labels)

        streamed = delta("loraserve_generation_tokens_total", server="worker") - 8 * outcomes["OK"]
        after_count = delta("loraserve_tokens_after_cancel_count")
        after_sum = delta("loraserve_tokens_after_cancel_sum")
        within = delta("loraserve_tokens_after_cancel_bucket", le=f"{AFTER_CANCEL_BOUND:.1f}")
        print(
            f"\n{STREAMS} streams + {LEFT} left = {dropped} upstream requests dropped {dict(upstream)} in"
            f" {dropped_at - started:.1f} s beside {sum(outcomes.values())} requests that stayed; the worker idle"
            f" {settled_in:.2f} s after the last drop; tokens after cancel: {after_sum:.0f} for"
            f" {after_count:.0f} cancels (at most {AFTER_CANCEL_BOUND}: {within:.0f}); tokens streamed to the router"
            f" for the dropped requests: {streamed:.0f}"
        )
        assert outcomes["OK"] > 0 and set(outcomes) == {"OK"}, outcomes
        assert upstream == {"http stream": 34 + 2 * 33, "grpc": 33, "http left": 1 + 2 + 1 + 2 + 1 + 2}
        assert delta("loraserve_requests_cancelled_total", reason="client") == dropped
        assert delta("loraserve_requests_cancelled_total", reason="deadline") == 0
        assert delta("loraserve_requests_cancelled_total", reason="stop_string") == 0
        assert after_count == dropped and within == dropped, (after_sum, after_count, within)
        assert _value(after, "loraserve_requests_running") == 0
        assert _value(after, "loraserve_requests_waiting") == 0
        assert _value(after, "loraserve_kv_cache_pages_used") == 0
        assert [(s.adapter, s.refcount) for s in slots.slots if s.refcount] == []
        # the router cancelled every upstream call; every gRPC client's cancel reached it as one
        worker_rpcs = dict(server="worker", method="Generate", code="CANCELLED")
        assert delta("loraserve_rpc_requests_total", **worker_rpcs) == dropped
        router_rpcs = dict(server="router", method="Generate", code="CANCELLED")
        assert (
            delta("loraserve_rpc_requests_total", router_before, router_after, **router_rpcs)
            == upstream["grpc"]
        )
        # INFO lines reach the logs read here (one per HTTP request), and nothing louder
        assert sum("http request" in line for line in router.log) >= STREAMS - upstream["grpc"] + LEFT
        for proc in (w, router):
            loud = [line for line in proc.log if LOUD.search(line)]
            assert loud == [], "".join(loud[:20])
