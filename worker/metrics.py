"""The worker's Prometheus metrics, read from the engine's latest snapshot at scrape time (nothing on the decode path)."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraserve.common.observability import LATENCY_BUCKETS
from loraserve.worker.accounting import AccountingCollector
from loraserve.worker.engine import Engine

ADAPTER_LOAD_SECONDS = Histogram(
    "loraserve_adapter_load_seconds", "Fetch + validate + host arrays of one adapter", buckets=LATENCY_BUCKETS
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
        info = GaugeMetricFamily(
            "loraserve_lora_requests_info",
            "Adapters of running and waiting requests (like vLLM's)",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        labels = [",".join(snap.running_adapters), ",".join(snap.waiting_adapters), str(len(snap.slots))]
        info.add_metric(labels, time.time())
        yield info


def register_engine_metrics(engine: Engine, top_adapters: int = 20) -> None:
    """The engine's gauges and counters, and per-adapter series for at most ``top_adapters`` adapters."""
    REGISTRY.register(EngineCollector(engine))
    engine.accounting.top_n = top_adapters
    REGISTRY.register(AccountingCollector(engine.accounting))
    engine.load_observer = ADAPTER_LOAD_SECONDS.observe
