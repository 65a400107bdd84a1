"""What the engine looks like after a step: one immutable value (``worker.snapshot_messages`` makes its protos).

The engine thread publishes a new ``EngineSnapshot`` after every step and every batch of commands;
the servicers (``ListSlots``), the registry heartbeat and the Prometheus collector read the latest one
and never the engine's private state.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.common.slots import SlotState
from loraserve.engine.slot_table import Slot


@dataclass(frozen=True)
class EngineSnapshot:
    step: int  # decode steps run so far
    slots: tuple[Slot, ...]
    running: int  # requests holding a decode row
    waiting: int  # accepted, not yet running (queued or waiting for their adapter)
    running_adapters: tuple[str, ...]  # resolved keys of running requests, sorted, unique
    waiting_adapters: tuple[str, ...]  # refs of waiting requests, sorted, unique
    adapter_loads: int  # adapters written into a slot
    tokens_out: int
    requests_done: int  # requests that ran and finished or failed
    host_tier: tuple[str, ...]  # keys of adapters kept in host memory, oldest first
    max_batch_size: int
    # paged KV cache (engine.kv_pages); pages exclude the reserved null page
    kv_page_size: int = 0  # tokens per page
    kv_pages_total: int = 0  # usable pages in the pool
    kv_pages_used: int = 0  # referenced by running requests
    kv_pages_cached: int = 0  # referenced by nobody, holding a cached prefix (reusable, reclaimed LRU)
    prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    prefix_query_tokens: int = 0  # prompt tokens looked up in it (0 with prefix caching off)
    preemptions: int = 0  # running requests sent back to the queue for want of pages
    cancelled: tuple[tuple[str, int], ...] = ()  # (reason, requests ended early): scheduler.CANCEL_REASONS
    # per cancel that ended a request, the tokens it took after the cancel was posted, counted by
    # scheduler.AFTER_CANCEL_BUCKETS (one more: above them), and their sum
    after_cancel: tuple[int, ...] = ()
    after_cancel_tokens: int = 0
    # speculative decoding (engine.speculative): verify steps, tokens drafted and kept, the verify steps the rule
    # ran only to re-measure, and the measured verify ÷ decode step time (0 until both are timed)
    spec_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_probes: int = 0
    spec_cost_ratio: float = 0.0

    @property
    def kv_utilisation(self) -> float:
        """Pages held by running requests over usable pages, 0-1 (cached idle pages count as free)."""
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0

    @property
    def free_slots(self) -> int:
        return sum(s.state == SlotState.EMPTY for s in self.slots)

    @property
    def used_slots(self) -> int:
        return len(self.slots) - self.free_slots

    def slot_of(self, adapter: str) -> Slot | None:
        return next((s for s in self.slots if s.adapter == adapter and s.state != SlotState.EMPTY), None)
