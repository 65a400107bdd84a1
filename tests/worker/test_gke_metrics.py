"""The GKE Inference Gateway model-server protocol: what the endpoint picker (EPP) scrapes from a worker.

The EPP reads four series by the names its flags give (deploy/k8s/gateway/epp.yaml): queued requests,
running requests, KV-cache utilisation (0-1), and a LoRA info gauge in vLLM's format (labels
``running_lora_adapters`` and ``waiting_lora_adapters``, comma-separated, and ``max_lora``; value = the
time of the update, the EPP keeps the newest series). This test runs a real engine on a tiny model under a
mixed-adapter load (more requests than decode rows, more adapters than slots, so some requests wait), scrapes
the Prometheus text exposition while it runs, and checks each series against the engine snapshot of the
same moment. With ``--metrics-compat vllm`` the same series also go out under vLLM's names (what llm-d's
router scrapes with no custom mapping), equal to loraserve's in every scrape.
"""

from __future__ import annotations

import time
import uuid

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.engine.request import EngineRequest, Sampling
from loraserve.worker.metrics import EngineCollector, VllmCollector
from tests.engines import started_engine
from tests.worker.fake_engine import Collector

ADAPTERS = ("all-r4", "qv-r8-rslora", "mlp-r16")  # three adapters for two slots: one waits for a slot
# test_engine.py's engine shapes, so that a test run compiles these programs once for both (JAX cache)
CONFIG = EngineConfig(max_batch_size=4, max_seq_len=64, max_loras=2, max_lora_rank=16, max_cpu_loras=1)
MODEL_NAME = "tiny-llama"
EPP_METRICS = {  # name -> (type, label names): what the EPP's flags point at
    "loraserve_requests_waiting": ("gauge", set()),
    "loraserve_requests_running": ("gauge", set()),
    "loraserve_kv_cache_utilisation": ("gauge", set()),
    "loraserve_lora_requests_info": ("gauge", {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}),
}


@pytest.fixture(scope="module")
def engine(llama_dir, adapter_dirs):
    """The suite's tiny Llama and PEFT adapters (tests/conftest.py), three of them for two slots."""
    with started_engine(
        llama_dir, CONFIG, {name: adapter_dirs[name] for name in ADAPTERS}, warmup=False
    ) as eng:
        yield eng


def scrape(registry: CollectorRegistry) -> dict:
    """``name -> family`` parsed from the text exposition, as the EPP receives it."""
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def consistent_scrape(engine: Engine, registry: CollectorRegistry):
    """A scrape and the snapshot it was made from: the engine published no new snapshot meanwhile."""
    for _ in range(10_000):
        before = engine.snapshot()
        families = scrape(registry)
        if engine.snapshot() is before:
            return before, families
    raise AssertionError("the engine published a new snapshot during every scrape")


def check(snap, families, now: float) -> None:
    for name, (kind, labels) in EPP_METRICS.items():
        family = families[name]
        assert family.type == kind, name
        (sample,) = family.samples  # one series per worker
        assert set(sample.labels) == labels, name
    value = {name: families[name].samples[0].value for name in EPP_METRICS}
    assert value["loraserve_requests_waiting"] == snap.waiting
    assert value["loraserve_requests_running"] == snap.running
    kv = value["loraserve_kv_cache_utilisation"]
    assert 0.0 <= kv <= 1.0
    assert kv == pytest.approx(snap.kv_utilisation, abs=1e-12)
    info = families["loraserve_lora_requests_info"].samples[0]
    split = lambda s: tuple(a for a in s.split(",") if a)  # noqa: E731  (the EPP splits on commas)
    assert split(info.labels["running_lora_adapters"]) == snap.running_adapters
    assert split(info.labels["waiting_lora_adapters"]) == snap.waiting_adapters
    assert int(info.labels["max_lora"]) == len(snap.slots) == CONFIG.max_loras
    assert abs(info.value - now) < 5.0  # the update time; the EPP keeps the newest series
    check_vllm(snap, families)


VLLM_SAME = {  # vLLM's name -> loraserve's series it repeats
    "vllm:num_requests_waiting": "loraserve_requests_waiting",
    "vllm:num_requests_running": "loraserve_requests_running",
    "vllm:kv_cache_usage_perc": "loraserve_kv_cache_utilisation",
    "vllm:gpu_cache_usage_perc": "loraserve_kv_cache_utilisation",
}


def check_vllm(snap, families) -> None:
    """vLLM's names carry the same values, with vLLM's labels."""
    for name, ours in VLLM_SAME.items():
        (sample,) = families[name].samples
        assert families[name].type == "gauge" and sample.labels == {"model_name": MODEL_NAME, "engine": "0"}
        assert sample.value == families[ours].samples[0].value, name
    (info,) = families["vllm:lora_requests_info"].samples
    assert info.labels == families["loraserve_lora_requests_info"].samples[0].labels
    (cache,) = families["vllm:cache_config_info"].samples
    want = {"block_size": str(snap.kv_page_size), "num_gpu_blocks": str(snap.kv_pages_total)}
    assert cache.labels == {**want, "enable_prefix_caching": "True"} and snap.kv_pages_total > 0


def test_the_four_epp_series_match_the_engine_under_a_mixed_adapter_load(engine) -> None:
    registry = CollectorRegistry()  # the worker registers the same collector on the default registry
    registry.register(EngineCollector(engine))
    registry.register(VllmCollector(engine, MODEL_NAME))

    idle, families = consistent_scrape(engine, registry)
    check(idle, families, time.time())
    assert (
        idle.running == idle.waiting == 0 and families["loraserve_kv_cache_utilisation"].samples[0].value == 0
    )

    collectors = []
    for i in range(12):  # 12 requests for 4 rows; adapters cycle a, b, c and the base model
        c = Collector()
        adapter = (*ADAPTERS, "")[i % 4]
        request = EngineRequest(uuid.uuid4().hex, adapter, [5, 17, 33, 100, 7], Sampling(max_tokens=48, ignore_eos=True), c)  # fmt: skip
        engine.submit(request)
        collectors.append(c)

    seen_waiting_adapter = seen_busy = False
    deadline = time.monotonic() + 60
    while not all(c.done.is_set() for c in collectors):
        assert time.monotonic() < deadline, "the load did not finish"
        snap, families = consistent_scrape(engine, registry)
        check(snap, families, time.time())
        seen_busy |= snap.running > 0 and snap.waiting > 0 and snap.kv_utilisation > 0
        seen_waiting_adapter |= bool(snap.running_adapters) and bool(snap.waiting_adapters)
        time.sleep(0.002)
    assert seen_busy, "never scraped the engine with requests both running and waiting"
    assert seen_waiting_adapter, "never scraped an adapter waiting while another ran"
    assert all(len(c.tokens) == 48 for c in collectors)

    done, families = consistent_scrape(engine, registry)
    check(done, families, time.time())
    info = families["loraserve_lora_requests_info"].samples[0]
    assert info.labels["running_lora_adapters"] == info.labels["waiting_lora_adapters"] == ""
