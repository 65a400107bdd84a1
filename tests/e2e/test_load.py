"""Load: 64 concurrent streams for 15 s (LORASERVE_LOAD_SECONDS sets a longer soak) through the router to
two workers with mixed adapters. Every request completes or gets a documented error, client counts reconcile with the
Prometheus counters of the router and the workers, and worker memory stays flat."""

from __future__ import annotations

import os
import random
import re
import threading
import time
import urllib.request
from collections import Counter

import pytest

from loraserve.client.sdk import Client
from loraserve.common.errors import LoraserveError
from loraserve.registry.config import RegistryConfig
from tests.conftest import with_test_xla_flags
from tests.e2e.compose_local import free_port
from tests.e2e.procs import loraserve_process, wait_for_workers, wait_healthy, worker_args
from tests.registry.conftest import start_registry

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SECONDS = float(os.environ.get("LORASERVE_LOAD_SECONDS", "15"))
STREAMS = 64
DOCUMENTED = {"RESOURCE_EXHAUSTED", "UNAVAILABLE"}  # acceptable under load; anything else is a bug


def _metric(port: int, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_64_streams_through_the_router(llama_dir, adapter_dirs, tmp_path) -> None:
    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"), lease_seconds=3)
    with start_registry(config, str(tmp_path / "s")) as reg:
        names = ["all-r4", "qv-r8-rslora", "mlp-r16", "attn-pattern"]
        for name in names:
            reg.client.push(adapter_dirs[name], name, "tiny")
        ports = {n: free_port() for n in ("w1", "w2", "router")}
        # prompts of 1-20 tokens + 1-8 new fit 32: warm-up skips the 64-token buckets no request needs
        shapes = ("--max-seq-len", "32", "--max-loras", "2", "--max-batch-size", "16", "--max-waiting", "512")
        worker = worker_args(llama_dir, reg.address, *shapes)
        env = with_test_xla_flags()  # the warm-up at the tests' XLA level: the soak lasts SECONDS either way
        with (
            loraserve_process([*worker, "--metrics-port", str(ports["w1"])], env=env) as w1,
            loraserve_process([*worker, "--metrics-port", str(ports["w2"])], env=env) as w2,
            loraserve_process(
                [
                    "router",
                    "serve",
                    "--port",
                    "0",
                    "--registry",
                    reg.address,
                    "--metrics-port",
                    str(ports["router"]),
                ]
            ) as router,
        ):
            for w in (w1, w2):
                wait_healthy(w.address, timeout=180)
            wait_for_workers(reg.client, 2)
            outcomes: Counter = Counter()
            tokens = Counter()
            lock = threading.Lock()
            stop_at = time.time() + SECONDS
            rss: dict[str, list[float]] = {"w1": [], "w2": []}

            def client_loop(seed: int) -> None:
                rnd = random.Random(seed)
                with Client(router.address, timeout=60) as client:
                    while time.time() < stop_at:
                        adapter = rnd.choice(["", *names])
                        n = rnd.randint(1, 8)
                        try:
                            out = client.complete(
                                [rnd.randint(3, 300) for _ in range(rnd.randint(1, 20))],
                                adapter=adapter,
                                max_tokens=n,
                                ignore_eos=True,
                            )
                            ok = out.completion_tokens == n and len(out.token_ids) == n
                            with lock:
                                outcomes["OK" if ok else "WRONG_LENGTH"] += 1
                                tokens["completion"] += out.completion_tokens
                                tokens["prompt"] += out.prompt_tokens
                        except LoraserveError as exc:
                            with lock:
                                outcomes[exc.code_name] += 1

            threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(STREAMS)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                rss["w1"].append(_rss_mb(w1.popen.pid))
                rss["w2"].append(_rss_mb(w2.popen.pid))
                time.sleep(1.0)
            for t in threads:
                t.join()
            assert outcomes["OK"] > 0 and set(outcomes) - {"OK"} <= DOCUMENTED, outcomes
            router_tokens = _metric(ports["router"], "loraserve_generation_tokens_total", '{server="router"}')
            worker_tokens = sum(
                _metric(ports[w], "loraserve_generation_tokens_total", '{server="worker"}')
                for w in ("w1", "w2")
            )
            worker_prompt = sum(
                _metric(ports[w], "loraserve_prompt_tokens_total", '{server="worker"}') for w in ("w1", "w2")
            )
            assert router_tokens == worker_tokens == tokens["completion"]
            assert worker_prompt == tokens["prompt"]
            assert (
                _metric(ports["router"], "loraserve_time_to_first_token_seconds_count", '{server="router"}')
                == outcomes["OK"]
            )
            for w in ("w1", "w2"):
                assert _metric(ports[w], "loraserve_requests_running") == 0
                samples = rss[w]
                warm = samples[len(samples) // 4]  # after warm-up traffic
                assert samples[-1] <= warm * 1.15 + 64, (
                    f"{w} memory grew from {warm:.0f} to {samples[-1]:.0f} MB"
                )
