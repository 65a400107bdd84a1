"""The worker's Prometheus metrics, read from the engine at scrape time (nothing on the decode path)."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraserve.common.observability import LATENCY_BUCKETS
from loraserve.worker.engine import Engine
from loraserve.worker.slots import SlotState

ADAPTER_LOAD_SECONDS = Histogram(
    "loraserve_adapter_load_seconds", "Fetch + validate + host arrays of one adapter", buckets=LATENCY_BUCKETS
)


class EngineCollector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        e = self.engine
        load = e.load()
        yield GaugeMetricFamily("loraserve_requests_running", "Requests decoding now", value=load["running"])
        yield GaugeMetricFamily(
            "loraserve_requests_waiting",
            "Requests queued or waiting for their adapter",
            value=load["waiting"],
        )
        slots = e.slots()
        yield GaugeMetricFamily(
            "loraserve_lora_slots_used",
            "Adapter slots holding an adapter",
            value=sum(s.state != SlotState.EMPTY for s in slots),
        )
        yield GaugeMetricFamily("loraserve_lora_slots", "Adapter slots on the device", value=len(slots))
        yield CounterMetricFamily(
            "loraserve_adapter_loads", "Adapters written into a slot", value=e.counters["adapter_loads"]
        )
        running = sorted({r.key for r in list(e._rows) if r is not None and r.key})
        waiting = sorted({r.adapter for r in [*list(e._waiting), *list(e._ready)] if r.adapter})
        info = GaugeMetricFamily(
            "loraserve_lora_requests_info",
            "Adapters of running and waiting requests (like vLLM's)",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric([",".join(running), ",".join(waiting), str(e.config.max_loras)], time.time())
        yield info


def register_engine_metrics(engine: Engine) -> None:
    REGISTRY.register(EngineCollector(engine))
    engine.load_observer = ADAPTER_LOAD_SECONDS.observe
