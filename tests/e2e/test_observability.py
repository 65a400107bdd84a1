"""Processes with --metrics-port: a worker's Prometheus text with real values and one JSON object per log line;
the RPC counters of the registry, worker and router after failing and succeeding calls."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraserve.client.registry_client import RegistryClient
from loraserve.client.sdk import Client
from loraserve.common.errors import LoraserveError
from tests.conftest import with_test_xla_flags
from tests.e2e.compose_local import free_port
from tests.e2e.procs import COMPOSE_SHAPES, loraserve_process, wait_for_workers, wait_healthy, worker_args
from tests.waiting import settled

pytestmark = pytest.mark.e2e
PROMPT = [5, 17, 33]


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not exported"
    return float(m.group(1))


def test_worker_metrics_and_json_logs(llama_dir, adapter_dirs, tmp_path) -> None:
    adapters = tmp_path / "adapters"
    shutil.copytree(adapter_dirs["all-r4"], adapters / "all-r4")
    port = free_port()
    args = [
        "worker",
        "--model",
        str(llama_dir),
        "--adapter-dir",
        str(adapters),
        "--port",
        "0",
        "--max-seq-len",
        "16",  # 3-token prompts + 4 new: warm-up compiles one prefill bucket, not 16/32/64
        "--max-loras",
        "2",
        "--kv-page-size",
        "2",
        "--metrics-port",
        str(port),
        "--warmup",
        "false",  # its programs compile on first use: what is counted here is requests, not warm-up
    ]
    # compile-bound (three requests of four tokens): the warm-up at the tests' XLA level
    with loraserve_process(args, env=with_test_xla_flags({"LORASERVE_LOG_FORMAT": "json"})) as proc:
        wait_healthy(proc.address)
        with Client(proc.address) as client:
            for adapter in ("all-r4", "all-r4", ""):
                assert (
                    client.complete(
                        [5, 17, 33], adapter=adapter, max_tokens=4, ignore_eos=True
                    ).completion_tokens
                    == 4
                )
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert _metric(text, "loraserve_time_to_first_token_seconds_count", '{server="worker"}') == 3
        assert _metric(text, "loraserve_inter_token_latency_seconds_count", '{server="worker"}') == 9
        assert _metric(text, "loraserve_generation_tokens_total", '{server="worker"}') == 12
        assert _metric(text, "loraserve_prompt_tokens_total", '{server="worker"}') == 9
        assert _metric(text, "loraserve_adapter_loads_total") == 1
        assert _metric(text, "loraserve_adapter_load_seconds_count") == 1
        # per adapter (#17 item 5): the local folder's adapter and the base model, with their own series
        assert _metric(text, "loraserve_adapter_requests_total", '{adapter="all-r4"}') == 2
        assert _metric(text, "loraserve_adapter_requests_total", '{adapter="base"}') == 1
        assert _metric(text, "loraserve_adapter_completion_tokens_total", '{adapter="all-r4"}') == 8
        assert (
            _metric(text, "loraserve_adapter_fetched_bytes_total", '{adapter="all-r4"}') == 0
        )  # a local folder
        assert (
            _metric(
                text, "loraserve_adapter_load_seconds_by_source_count", '{adapter="all-r4",source="local"}'
            )
            == 1
        )
        assert _metric(text, "loraserve_lora_slots_used") == 1 and _metric(text, "loraserve_lora_slots") == 2
        assert _metric(text, "loraserve_requests_running") == 0
        # paged KV: 8 rows x 8 pages of 2 tokens; the second all-r4 request found the first one's full
        # first page [5, 17] (the last prompt token is always recomputed); the base request shares nothing
        assert _metric(text, "loraserve_kv_cache_pages") == 64
        assert _metric(text, "loraserve_kv_cache_utilisation") == 0.0
        assert _metric(text, "loraserve_prefix_cache_queries_total") == 9
        assert _metric(text, "loraserve_prefix_cache_hits_total") == 2
        assert _metric(text, "loraserve_preemptions_total") == 0
        assert (
            'loraserve_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
            in text
        )
    records = [json.loads(line) for line in proc.log if line.startswith("{")]
    finished = [r for r in records if r["message"] == "finished"]
    assert len(finished) == 3 and {r["adapter"] for r in finished} == {"all-r4", ""}
    assert all(len(r["request_id"]) == 32 and r["level"] == "INFO" for r in finished)


def _rpc_samples(port: int) -> dict[tuple[str, str, str], float]:
    """``loraserve_rpc_requests_total`` of one process: (server, method, code) -> count."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "loraserve_rpc_requests_total":
                out[(s.labels["server"], s.labels["method"], s.labels["code"])] = s.value
            if s.name == "loraserve_rpc_seconds_count":
                out[(s.labels["server"], s.labels["method"], "seconds_count")] = s.value
    return out


def _settled(port: int, want: dict[tuple[str, str, str], float], timeout: float = 10.0) -> dict:
    """The samples of ``want``'s keys once they match (a stream is recorded just after its last message)."""

    def picked() -> dict:
        got = _rpc_samples(port)
        return {key: got.get(key, 0.0) for key in want}

    return settled(picked, lambda p: p == want, timeout, interval=0.1)


def test_every_server_records_its_rpcs_with_status_codes(llama_dir, adapter_dirs, tmp_path) -> None:
    """Registry, worker and router processes, one failing and one succeeding call each: each /metrics holds
    exactly those loraserve_rpc_requests_total samples (the interceptor, not the servicers, records them)."""
    metrics = {name: free_port() for name in ("registry", "worker", "router")}
    reg_port = free_port()
    registry_address = f"127.0.0.1:{reg_port}"
    registry_args = ["registry", "serve", "--port", str(reg_port), "--metrics-port", str(metrics["registry"])]
    registry_args += ["--db", f"sqlite:///{tmp_path / 'r.db'}", "--storage", str(tmp_path / "store")]
    metrics_port = ("--metrics-port", str(metrics["worker"]))
    args = worker_args(llama_dir, registry_address, *COMPOSE_SHAPES, *metrics_port, warmup=False)
    router_args = ["router", "serve", "--port", "0", "--registry", registry_address]
    router_args += ["--metrics-port", str(metrics["router"])]
    with (
        loraserve_process(registry_args),
        loraserve_process(args, env=with_test_xla_flags()) as worker,
        loraserve_process(router_args) as router,
        RegistryClient(registry_address) as registry,
    ):
        with pytest.raises(LoraserveError) as exc:
            registry.get("nope")
        assert exc.value.code_name == "NOT_FOUND"
        assert registry.push(adapter_dirs["all-r4"], "counted", "tiny").version == 1
        with Client(worker.address) as client:
            with pytest.raises(LoraserveError) as exc:
                client.complete([], max_tokens=2)
            assert exc.value.code_name == "INVALID_ARGUMENT"
            assert client.complete(PROMPT, max_tokens=2, ignore_eos=True).completion_tokens == 2
        assert len(wait_for_workers(registry, 1)) == 1
        with Client(router.address) as client:
            with pytest.raises(LoraserveError) as exc:
                client.complete(PROMPT, adapter="nope", max_tokens=2)
            assert exc.value.code_name == "NOT_FOUND"
            assert client.complete(PROMPT, max_tokens=2, ignore_eos=True).completion_tokens == 2

        want_registry = {
            ("registry", "GetAdapter", "NOT_FOUND"): 1,
            ("registry", "GetAdapter", "OK"): 0,
            ("registry", "UploadAdapter", "OK"): 1,
            ("registry", "RegisterWorker", "OK"): 1,
            ("registry", "LocateAdapter", "NOT_FOUND"): 1,  # the router asking for "nope"
            ("registry", "LocateAdapter", "OK"): 1,  # the router asking for the base model
            ("registry", "GetAdapter", "seconds_count"): 1,
        }
        want_worker = {
            ("worker", "Generate", "INVALID_ARGUMENT"): 1,
            ("worker", "Generate", "OK"): 2,  # one direct, one through the router
            ("worker", "Generate", "seconds_count"): 3,
        }
        want_router = {
            ("router", "Generate", "NOT_FOUND"): 1,
            ("router", "Generate", "OK"): 1,
            ("router", "Generate", "seconds_count"): 2,
        }
        assert _settled(metrics["registry"], want_registry) == want_registry
        assert _settled(metrics["worker"], want_worker) == want_worker
        assert _settled(metrics["router"], want_router) == want_router
        router_samples = _rpc_samples(metrics["router"])
        assert {k for k in router_samples if k[2] != "seconds_count" and k[1] == "Generate"} == {
            ("router", "Generate", "NOT_FOUND"),
            ("router", "Generate", "OK"),
        }
