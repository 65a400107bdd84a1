"""What an unmodified llm-d router (the Gateway API Inference Extension's endpoint picker) does with a model
server, done to a real ``loraserve worker`` process started with the flags docs/deploy.md gives: it scrapes
vLLM's metric names, rolls an adapter out and back through vLLM's runtime LoRA endpoints, and follows the
prefix cache through KV events on ZMQ, whose blocks name their adapter. Each is tested on its own elsewhere
(tests/worker/test_gke_metrics.py, tests/httpapi/test_runtime_lora.py, tests/worker/test_kv_events.py); here
they run together against one process, as the router sees it."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import with_test_xla_flags
from tests.e2e.compose_local import free_port
from tests.e2e.procs import loraserve_process, wait_healthy
from tests.waiting import settled

pytestmark = pytest.mark.e2e
PAGE = 16
PROMPT = list(range(3, 3 + 2 * PAGE + 5))  # two full pages and a part


def _vllm(url: str) -> dict[str, list]:
    """The ``vllm:`` samples of one scrape: name -> [(labels, value)]."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _lora_info(url: str) -> dict[str, str]:
    (info,) = _vllm(url)["vllm:lora_requests_info"]
    return info[0]


def test_an_llmd_router_scrapes_rolls_out_and_follows_the_cache(llama_dir, adapter_dirs, tmp_path) -> None:
    import zmq

    served = tmp_path / "served"
    shutil.copytree(adapter_dirs["qv-r8-rslora"], served / "conf-a")
    http, events = free_port(), free_port()
    args = [
        "worker", "--model", str(llama_dir), "--port", "0", "--http-port", str(http),
        "--max-seq-len", "64", "--max-batch-size", "2", "--max-loras", "2", "--kv-page-size", str(PAGE),
        "--metrics-compat", "vllm", "--kv-events", f"tcp://127.0.0.1:{events}",
        "--lora-import-prefixes", str(served),
        "--warmup", "false",  # compile on first use: the router needs no warm worker (and CI saves the time)
    ]  # fmt: skip
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    with loraserve_process(args, env=with_test_xla_flags()) as proc:
        wait_healthy(proc.address)
        url = f"http://127.0.0.1:{http}"
        sub.connect(f"tcp://127.0.0.1:{events}")

        # 1. the scrape an idle server answers
        idle = _vllm(url)
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert [value for _, value in idle[name]] == [0.0], name
        assert _lora_info(url) == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        (cache_info,) = idle["vllm:cache_config_info"]
        assert cache_info[0]["block_size"] == str(PAGE) and cache_info[0]["enable_prefix_caching"] == "True"

        # 2. an adapter rollout through vLLM's runtime endpoint, as the router's rollout controller does it
        loaded = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "conf-a", "lora_path": str(served / "conf-a")},
            timeout=60,
        )
        assert loaded.status_code == 200, loaded.text
        assert "conf-a" in {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        time.sleep(
            0.3
        )  # ZMQ's slow joiner: the subscription reaches the publisher before any block is stored

        # 3. while a request for it decodes, the scrape names it running (what the picker's LoRA affinity reads)
        body = {"model": "conf-a", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True}
        chunks: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(line)
                        started.set()

        client = threading.Thread(target=stream)
        client.start()
        assert started.wait(120)
        running = settled(lambda: _lora_info(url), lambda i: i["running_lora_adapters"] == "conf-a", 10, 0.01)
        assert running["max_lora"] == "2"
        client.join(120)
        assert len(chunks) >= 2
        assert settled(lambda: _lora_info(url), lambda i: i["running_lora_adapters"] == "", 10, 0.05)

        # 4. the KV events: the prompt's two full pages stored under the adapter's name, with its tokens
        batches = []
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b""  # vLLM's default topic
            batches.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        assert [s for s, _ in batches] == list(range(batches[0][0], batches[0][0] + len(batches)))
        stored = [e for _, (_, evs) in batches for e in evs if e[0] == "BlockStored"]
        assert stored and all(e[7] == "conf-a" for e in stored)
        tokens = [t for e in stored for t in e[3]]
        assert tokens[: 2 * PAGE] == PROMPT[: 2 * PAGE] and all(e[4] == PAGE for e in stored)

        # 5. rolled back: unloaded, no longer offered, the scrape forgets it
        unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "conf-a"}, timeout=60)
        assert unloaded.status_code == 200, unloaded.text
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "conf-a"}, timeout=10)
        assert gone.status_code == 404
        assert _lora_info(url) == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    sub.close(0)
