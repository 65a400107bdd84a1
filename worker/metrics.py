"""The worker's Prometheus metrics, read from the engine's latest snapshot at scrape time (nothing on the decode path)."""

from __future__ import annotations

import math
import time

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from loraserve.common.observability import LATENCY_BUCKETS
from loraserve.engine.accounting import AccountingCollector
from loraserve.engine.engine import Engine
from loraserve.engine.scheduler import AFTER_CANCEL_BUCKETS
from loraserve.engine.snapshot import EngineSnapshot

ADAPTER_LOAD_SECONDS = Histogram(
    "loraserve_adapter_load_seconds", "Fetch + validate + host arrays of one adapter", buckets=LATENCY_BUCKETS
)


def speculative_metrics(snap: EngineSnapshot):
    """Speculative decoding (docs/speculative.md): verify steps, tokens drafted and kept, the rule's probes and
    its measured verify ÷ decode cost (per adapter: the loraserve_adapter_*draft_tokens series)."""
    for name, help_text, value in (
        ("verify_steps", "Verify steps (speculative decoding) run instead of decode steps", snap.spec_steps),
        ("draft_tokens", "Tokens drafted for verify steps", snap.spec_proposed),
        ("accepted_tokens", "Drafted tokens the model kept", snap.spec_accepted),
        ("probes", "Verify steps run to re-measure although the rule did not choose them", snap.spec_probes),
    ):
        yield CounterMetricFamily(f"loraserve_speculative_{name}", help_text, value=value)
    yield GaugeMetricFamily(
        "loraserve_speculative_verify_cost_ratio",
        "A verify step's time over a decode step's, as the scheduler measured them (0 until both are timed)",
        value=snap.spec_cost_ratio,
    )


class EngineCollector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        snap = self.engine.snapshot()
        yield GaugeMetricFamily("loraserve_requests_running", "Requests decoding now", value=snap.running)
        yield GaugeMetricFamily(
            "loraserve_requests_waiting", "Requests queued or waiting for their adapter", value=snap.waiting
        )
        yield GaugeMetricFamily(
            "loraserve_lora_slots_used", "Adapter slots holding an adapter", value=snap.used_slots
        )
        yield GaugeMetricFamily("loraserve_lora_slots", "Adapter slots on the device", value=len(snap.slots))
        yield CounterMetricFamily(
            "loraserve_adapter_loads", "Adapters written into a slot", value=snap.adapter_loads
        )
        yield GaugeMetricFamily(
            "loraserve_kv_cache_utilisation",
            "Fraction (0-1) of the KV pool's pages held by running requests",
            value=snap.kv_utilisation,
        )
        yield GaugeMetricFamily(
            "loraserve_kv_cache_pages", "Usable pages in the KV pool", value=snap.kv_pages_total
        )
        yield GaugeMetricFamily(
            "loraserve_kv_cache_pages_used",
            "Pages of the KV pool held by running requests",
            value=snap.kv_pages_used,
        )
        yield GaugeMetricFamily(
            "loraserve_kv_cache_pages_cached",
            "Pages held by no request that keep a cached prefix (reused on a hit, reclaimed LRU)",
            value=snap.kv_pages_cached,
        )
        yield CounterMetricFamily(
            "loraserve_prefix_cache_queries",
            "Prompt tokens looked up in the adapter-keyed prefix cache",
            value=snap.prefix_query_tokens,
        )
        yield CounterMetricFamily(
            "loraserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            value=snap.prefix_hit_tokens,
        )
        yield CounterMetricFamily(
            "loraserve_preemptions",
            "Running requests sent back to the queue for want of KV pages (recomputed later)",
            value=snap.preemptions,
        )
        yield from cancellation_metrics(snap)
        yield from speculative_metrics(snap)
        info = GaugeMetricFamily(
            "loraserve_lora_requests_info",
            "Adapters of running and waiting requests (like vLLM's)",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        labels = [",".join(snap.running_adapters), ",".join(snap.waiting_adapters), str(len(snap.slots))]
        info.add_metric(labels, time.time())
        yield info


def cancellation_metrics(snap: EngineSnapshot):
    """What clients that left cost: requests ended early by reason, and per cancelled request the tokens the
    engine still gave it after the cancel was posted (at most one engine step's: ``scheduler.Cancel``)."""
    cancelled = CounterMetricFamily(
        "loraserve_requests_cancelled",
        "Requests ended before their finish: their client went away (client), their deadline passed "
        "(deadline), a stop string ended them (stop_string)",
        labels=["reason"],
    )
    for reason, count in snap.cancelled:
        cancelled.add_metric([reason], count)
    yield cancelled
    counts = snap.after_cancel or (0,) * (len(AFTER_CANCEL_BUCKETS) + 1)
    cumulative, buckets = 0, []
    for bound, count in zip((*AFTER_CANCEL_BUCKETS, math.inf), counts, strict=True):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))  # le="2.0", "+Inf": as prometheus_client writes
    yield HistogramMetricFamily(
        "loraserve_tokens_after_cancel",
        "Per cancelled request, tokens the engine generated for it after its cancel was posted",
        buckets=buckets,
        sum_value=snap.after_cancel_tokens,
    )


class VllmCollector:
    """The model-server protocol under vLLM's names (``--metrics-compat vllm``), read from the same snapshot:
    what llm-d's router (the Gateway API Inference Extension's endpoint picker) scrapes to pick a server —
    queue depth, KV-cache usage, and which LoRA adapters run, wait and fit (``max_lora``)."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self):
        snap = self.engine.snapshot()
        labels, values = ["model_name", "engine"], [self.model_name, "0"]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in model execution batches", snap.running),
            ("vllm:num_requests_waiting", "Requests waiting to be processed", snap.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent", snap.kv_utilisation),
            (
                "vllm:gpu_cache_usage_perc",
                "KV-cache usage, 1 means 100 percent (vLLM's older name)",
                snap.kv_utilisation,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        # the value is a timestamp (the router keeps the newest series), as vLLM sets it
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric(
            [str(len(snap.slots)), ",".join(snap.running_adapters), ",".join(snap.waiting_adapters)],
            time.time(),
        )
        yield info
        cache = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the KV cache config",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        prefix = str(bool(self.engine.config.enable_prefix_caching))
        cache.add_metric([str(snap.kv_page_size), str(snap.kv_pages_total), prefix], 1.0)
        yield cache


def register_engine_metrics(
    engine: Engine, top_adapters: int = 20, compat: str = "", model_name: str = ""
) -> None:
    """The engine's gauges and counters, and per-adapter series for at most ``top_adapters`` adapters; with
    ``compat="vllm"`` also vLLM's names (:class:`VllmCollector`)."""
    REGISTRY.register(EngineCollector(engine))
    if compat == "vllm":
        REGISTRY.register(VllmCollector(engine, model_name))
    engine.accounting.top_n = top_adapters
    REGISTRY.register(AccountingCollector(engine.accounting))
    engine.load_observer = ADAPTER_LOAD_SECONDS.observe
