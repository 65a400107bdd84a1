"""Scheduler + residency over the FakeRunner, driven step by step on the test's thread (no JAX, no threads).

Adapter loads run inline and post their ``Prepared`` to the inbox, so a cold adapter becomes resident on
the step after its first request is handled; deadlines read ``Harness.now``; the slot table's LRU clock
ticks once per use.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field

import numpy as np
from safetensors.numpy import save

from loraserve.adapters.errors import AdapterNotFoundError
from loraserve.adapters.refs import split_ref
from loraserve.adapters.running_caps import RunningCaps
from loraserve.adapters.sources import FetchedAdapter
from loraserve.engine.config import EngineConfig
from loraserve.engine.fake_runner import FakeRunner
from loraserve.engine.request import EngineRequest, Failed, Finished, Sampling, Token
from loraserve.engine.residency import Residency
from loraserve.engine.scheduler import Scheduler
from loraserve.models.config import ModelConfig

TINY = ModelConfig(
    model_type="llama",
    vocab_size=50,
    hidden_size=8,
    intermediate_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    eos_token_ids=(49,),
)


def adapter_files(rank: int = 2, seed: int = 0) -> tuple[bytes, bytes]:
    """A real PEFT adapter for ``TINY`` (q_proj only), as (adapter_config.json, safetensors) bytes."""
    rng = np.random.default_rng(seed)
    h, q = TINY.module_shapes()["q_proj"]
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    weights = {
        f"{prefix}.lora_A.weight": rng.standard_normal((rank, h)).astype(np.float32),
        f"{prefix}.lora_B.weight": rng.standard_normal((q, rank)).astype(np.float32),
    }
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj"]}
    return json.dumps(config).encode(), save(weights)


class MemorySource:
    """Adapters by name from memory; an entry that is an exception is raised by ``fetch``."""

    def __init__(self, adapters: dict[str, tuple[bytes, bytes] | Exception]) -> None:
        self.adapters = adapters
        self.fetches: list[str] = []
        self.gate: threading.Event | None = None  # when set, fetch waits for it

    def resolve(self, ref: str) -> str:
        split_ref(ref)
        if ref not in self.adapters:
            raise AdapterNotFoundError(f"adapter {ref!r} is not known to this worker")
        return ref

    def fetch(self, key: str) -> FetchedAdapter:
        if self.gate is not None:
            self.gate.wait()
        self.fetches.append(key)
        item = self.adapters[key]
        if isinstance(item, Exception):
            raise item
        return FetchedAdapter(key, *item)


def source_of(*names: str, **errors: Exception) -> MemorySource:
    return MemorySource(
        {
            **{n: adapter_files(seed=i) for i, n in enumerate(names)},
            **{k.replace("_", "-"): e for k, e in errors.items()},
        }
    )


@dataclass
class Collector:
    request_id: str = ""
    events: list = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, event) -> None:
        self.events.append(event)
        if isinstance(event, Finished | Failed):
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, Token | Finished) and e.token_id is not None]

    @property
    def end(self):
        return self.events[-1]


class Harness:
    def __init__(self, config: EngineConfig, source: MemorySource, caps: RunningCaps | None = None) -> None:
        self.config, self.source = config, source
        self.inbox: list = []
        self.now = 0.0
        self.runner = FakeRunner.for_config(TINY.vocab_size, config)
        ticks = itertools.count(1)
        self.residency = Residency(
            self.runner,
            source,
            TINY,
            config,
            self.inbox.append,
            lambda fn, ref: fn(ref),
            clock=lambda: float(next(ticks)),
        )
        self.scheduler = Scheduler(
            self.runner, self.residency, TINY, config, clock=lambda: self.now, caps=caps
        )
        self._ids = itertools.count()

    def submit(
        self, adapter: str = "", prompt=(5,), deadline: float | None = None, prediction=None, **sampling
    ) -> Collector:
        """Accept a request (raises what ``Engine.submit`` raises) and post it; returns its event collector."""
        sink = Collector(f"r{next(self._ids)}")
        req = EngineRequest(sink.request_id, adapter, list(prompt), Sampling(**sampling), sink, deadline)
        req.prediction = prediction
        self.inbox.append(self.scheduler.accept(req))
        return sink

    def post(self, command) -> None:
        self.inbox.append(command)

    def step(self, n: int = 1) -> None:
        """``n`` engine rounds: handle the commands posted so far, then one scheduler step."""
        for _ in range(n):
            commands, self.inbox[:] = list(self.inbox), []
            for command in commands:
                self.scheduler.handle(command)
            self.scheduler.step()
            self.scheduler.flush()

    def run(self, *collectors: Collector, limit: int = 100) -> None:
        for _ in range(limit):
            if all(c.done.is_set() for c in collectors):
                return
            self.step()
        raise AssertionError("requests did not finish")
