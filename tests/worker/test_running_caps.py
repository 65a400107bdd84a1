"""Running caps (adapters.running_caps, set in the registry): a worker runs at most K requests of one adapter
name, or of one tenant's adapters, at once; the capped requests wait where they are while the requests
behind them go ahead. Exact step sequences over the FakeRunner (as test_fair_slots.py), then the wiring:
GetAdapter and heartbeat replies from a real registry reach the engine's scheduler."""

from __future__ import annotations

import asyncio

from loraserve.adapters.files import CONFIG_FILE, WEIGHTS_FILE
from loraserve.adapters.running_caps import Cap, RunningCaps, adapter_names
from loraserve.engine.config import EngineConfig
from loraserve.registry.config import RegistryConfig
from tests.registry.conftest import start_registry
from tests.waiting import wait_until
from tests.worker.fake_engine import TINY, Harness, adapter_files, source_of

MODEL = "fake-tiny"


class Timeline:
    """A harness that records, per step, the adapters of the running rows and when each request started."""

    def __init__(self, caps: dict[str, Cap], batch: int = 4) -> None:
        config = EngineConfig(
            max_batch_size=batch, max_seq_len=32, max_loras=3, max_lora_rank=4, max_cpu_loras=8
        )
        self.caps = RunningCaps(caps)
        self.h = Harness(config, source_of("a", "b", "c"), self.caps)
        self.sent: list[tuple[str, object]] = []
        self.started: dict[int, int] = {}
        self.rows: list[str] = []

    def submit(self, *names: str, max_tokens: int = 4) -> None:
        for name in names:
            self.sent.append((name, self.h.submit(name, max_tokens=max_tokens)))

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.h.step()
            for _, c in self.sent:
                if c.events and id(c) not in self.started:
                    self.started[id(c)] = len(self.rows)
            self.rows.append("".join(sorted(r.req.adapter for r in self.h.scheduler.rows if r is not None)))

    def starts(self, name: str) -> list[int | None]:
        return [self.started.get(id(c)) for n, c in self.sent if n == name]


def test_an_adapter_cap_holds_and_the_requests_behind_go_ahead() -> None:
    """Four "a" then two "b" at once, batch 4. Capped at 1: "a" runs one at a time (starts 3 steps apart, its
    4 tokens each) and both "b" start at once behind the first "a"; uncapped, "a" fills the batch and "b"
    waits for it."""
    capped = Timeline({"a": Cap(1)})
    capped.submit("a", "a", "a", "a", "b", "b")
    capped.step(14)
    assert max(row.count("a") for row in capped.rows) == 1
    assert capped.starts("a") == [1, 4, 7, 10] and capped.starts("b") == [1, 2]
    assert all(c.done.is_set() for _, c in capped.sent)

    free = Timeline({})
    free.submit("a", "a", "a", "a", "b", "b")
    free.step(14)
    assert max(row.count("a") for row in free.rows) == 4
    assert free.starts("a") == [1, 1, 2, 2] and free.starts("b") == [4, 4]


def test_a_tenant_cap_covers_its_adapters_together() -> None:
    """ "a" and "b" belong to tenant t, capped at 2; "c" has no cap. A flood of both (three each) and one
    "c" behind them: never more than 2 of t's requests run, and "c" starts in the first steps."""
    t = Timeline({"a": Cap(0, "t", 2), "b": Cap(0, "t", 2)})
    t.submit("a", "b", "a", "b", "a", "b", "c")
    t.step(20)
    assert max(row.count("a") + row.count("b") for row in t.rows) == 2
    assert t.starts("c") == [2]
    assert all(c.done.is_set() for _, c in t.sent)
    # the adapter cap and its tenant's both bind: "a" at most 1 of t's 3
    both = Timeline({"a": Cap(1, "t", 3), "b": Cap(0, "t", 3)})
    both.submit("a", "a", "a", "b", "b", "b")
    both.step(20)
    assert max(row.count("a") for row in both.rows) == 1
    assert max(row.count("a") + row.count("b") for row in both.rows) == 3
    assert all(c.done.is_set() for _, c in both.sent)


def test_a_changed_cap_applies_at_the_next_admission_and_preempts_nobody() -> None:
    """Four long "a" run; the cap drops to 1: they run to their end, then the two new ones start one after
    the other (each takes one step: 2 tokens)."""
    t = Timeline({})
    t.submit("a", "a", "a", "a", max_tokens=8)
    t.step(3)
    assert t.rows[-1] == "aaaa"
    t.caps.replace({"a": Cap(1)})  # lowered below what runs: those finish, nobody new starts meanwhile
    t.submit("a", "a", max_tokens=2)
    t.step(12)
    assert t.rows[:9] == ["", "aa", "aaaa", "aaaa", "aaaa", "aaaa", "aaaa", "aa", ""]  # nobody preempted
    assert t.starts("a") == [1, 1, 2, 2, 9, 10]  # the new two one at a time, once the four have ended
    t.caps.replace({}, covered=["a"])  # the registry's answer for "a": no cap any more
    assert t.caps.table() == {}


def test_names_a_request_counts_against() -> None:
    assert adapter_names("bot@3") == ("bot",)
    assert adapter_names("bot*0.5+helper@2*0.5") == ("bot", "helper")
    assert adapter_names("/models/local-adapter") == () and adapter_names("") == ()
    caps = RunningCaps({"a": Cap(1), "b": Cap()})
    assert caps.table() == {"a": Cap(1)}  # no cap: not kept
    caps.note("b", Cap(0, "t", 2))
    caps.replace({"a": Cap(3)}, covered=["a"])
    assert caps.table() == {"a": Cap(3), "b": Cap(0, "t", 2)}  # "b" is not covered by that answer
    caps.note("b", Cap())
    assert caps.table() == {"a": Cap(3)}


def test_the_registry_caps_reach_the_scheduler(tmp_path) -> None:
    """GetAdapter (as the worker resolves a name) and every heartbeat reply set the engine's caps."""
    store = str(tmp_path / "store")
    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'registry.db'}", storage=store, max_lora_rank=16)
    folder = tmp_path / "adapter"  # an adapter of the fake runner's tiny model
    folder.mkdir()
    config_bytes, weights = adapter_files()
    (folder / CONFIG_FILE).write_bytes(config_bytes)
    (folder / WEIGHTS_FILE).write_bytes(weights)
    with start_registry(config, store) as reg:
        _caps_reach_the_scheduler(reg, folder)


def _caps_reach_the_scheduler(reg, folder) -> None:
    from loraserve.engine.engine import Engine
    from loraserve.engine.fake_runner import FakeRunner
    from loraserve.worker.registration import Registration
    from loraserve.worker.registry_source import RegistryAdapterSource

    reg.client.push(folder, "bot", MODEL, labels={"tenant": "acme"})
    reg.client.push(folder, "solo", MODEL)
    reg.client.set_running_limit(2, adapter="bot")
    reg.client.set_running_limit(5, tenant="acme")
    config = EngineConfig(max_batch_size=4, max_seq_len=32, max_loras=2, max_lora_rank=16)
    source = RegistryAdapterSource(reg.address)
    engine = Engine(
        None, config, source, runner=FakeRunner.for_config(TINY.vocab_size, config), model_config=TINY
    )
    try:
        assert engine.scheduler.caps is source.caps is engine.caps
        assert source.resolve("bot") == "bot@1" and source.resolve("solo") == "solo@1"
        assert engine.caps.table() == {"bot": Cap(2, "acme", 5)}
        engine.start(warmup=False)
        engine.load_adapter("bot").result(timeout=30)
        reg.client.set_running_limit(1, adapter="bot")  # changed: the next heartbeat says so

        async def one_heartbeat() -> None:
            registration = Registration(engine, reg.address, "127.0.0.1:1", MODEL)
            task = asyncio.create_task(registration.run())
            try:
                await asyncio.to_thread(wait_until, lambda: registration.heartbeats >= 1, "a heartbeat")
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        asyncio.run(one_heartbeat())
        assert engine.caps.table() == {"bot": Cap(1, "acme", 5)}
    finally:
        engine.stop()
        source.close()
