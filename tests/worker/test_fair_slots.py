"""Fair sharing of slots (``EngineConfig.fair_slots``, engine.residency): when a loaded adapter finds every
slot referenced, the slot filled longest ago stops taking new requests and changes hands once its running
ones end; its own new requests wait for their turn. Over the FakeRunner with exact step counts (tokens as
in test_scheduler.py: next = (last + slot + 2) % 50). The bound: a request whose adapter is not resident
starts within (its load: one step) + (the drained slot's admitted requests' remaining steps: max_tokens)
of steps; off, it waits until some slot happens to go idle, which a steady stream never lets happen."""

from __future__ import annotations

import pytest

from loraserve.engine.config import EngineConfig
from loraserve.engine.request import Finished, Started, Token
from loraserve.engine.scheduler import Cancel
from tests.worker.fake_engine import Harness, source_of


def _config(fair: bool, **kw) -> EngineConfig:
    base = dict(
        max_batch_size=4, max_seq_len=32, max_loras=2, max_lora_rank=4, max_cpu_loras=8, fair_slots=fair
    )
    return EngineConfig(**{**base, **kw})


class Flood:
    """A harness whose requests remember the step they were submitted in and the step they started in."""

    def __init__(self, fair: bool, names: str = "abcde") -> None:
        self.h = Harness(_config(fair), source_of(*names))
        self.sent: list[tuple[str, int, object]] = []
        self.started: dict[int, int] = {}
        self.steps = 0

    def submit(self, name: str, max_tokens: int = 3):
        c = self.h.submit(name, max_tokens=max_tokens)
        self.sent.append((name, self.steps, c))
        return c

    def step(self) -> None:
        self.h.step()
        for _, _, c in self.sent:
            if c.events and id(c) not in self.started:
                self.started[id(c)] = self.steps
        self.steps += 1

    def waits(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for name, sent, c in self.sent:
            out.setdefault(name, []).append(self.started.get(id(c), 10_000) - sent)
        return out


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "off"])
def test_a_rare_adapter_starts_within_the_bound_behind_a_flood(fair) -> None:
    """Two slots held by a steady alternating stream for "a" and "b" (one request a step, 3 tokens each):
    "c" arrives at step 6. Fair: "a"'s slot (filled first) drains; "c" is written into it and starts 2 steps
    after it arrived; "a" comes back into the next slot to drain, its requests wait at most 1 step. Off:
    "c" never starts in 60 steps."""
    f = Flood(fair)
    for step in range(60):
        f.submit("ab"[step % 2])
        if step == 6:
            rare = f.submit("c", max_tokens=2)
        f.step()
    waits = f.waits()
    if not fair:
        assert not rare.events and waits["c"] == [10_000 - 6]
        assert [i for i, _ in f.h.runner.writes] == [0, 1]
        return
    assert waits["c"] == [2]
    assert rare.events == [Started("c"), Token(7), Finished("length", 1, 2, token_id=9)]  # slot 0's tokens
    assert max(waits["a"]) <= 1 and max(waits["b"]) <= 1
    assert [i for i, _ in f.h.runner.writes] == [0, 1, 0, 0]  # a, b, then c into a's slot, a back after c


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "off"])
def test_many_adapters_over_two_slots_all_wait_a_bounded_time(fair) -> None:
    """ "a" and "b" every step in turn, "c", "d", "e" once every 10 steps each, 120 steps: fair, nobody waits
    more than 3 steps (the bound: one load + 3 tokens), at the price of 26 slot writes instead of 5; off,
    the rare ones wait up to 117 steps (until the flood stops)."""
    f = Flood(fair)
    for step in range(120):
        f.submit("ab"[step % 2])
        if step % 10 == 3:
            f.submit("cde"[(step // 10) % 3])
        f.step()
    for _ in range(20):  # the flood stops; everyone left finishes
        f.step()
    assert all(c.done.is_set() for _, _, c in f.sent)
    waits = f.waits()
    worst = {name: max(w) for name, w in waits.items()}
    if fair:
        assert worst == {"a": 2, "b": 2, "c": 3, "d": 3, "e": 3}
        assert f.h.scheduler.snapshot().adapter_loads == 26
    else:
        assert worst["c"] == 117 and min(worst[n] for n in "cde") > 90
        assert f.h.scheduler.snapshot().adapter_loads == 5


def test_a_drain_stops_when_nobody_waits_for_the_slot_any_more() -> None:
    """Long requests hold both slots ("a", "b"); "c" arrives, "a"'s slot drains for it and a new "a" request
    is held back; "c" is cancelled: the drain stops, the held request takes its reference on the slot "a"
    never left, and nothing else was written."""
    f = Flood(True)
    long_a, long_b = f.submit("a", max_tokens=20), f.submit("b", max_tokens=20)
    f.step()
    f.step()
    rare = f.submit("c")
    f.step()  # "c" loads
    f.step()  # prepared; no slot free: "a"'s (filled first) drains
    assert f.h.residency.draining == {0: "a"}
    held = f.submit("a", max_tokens=2)
    f.step()
    assert not held.events and list(f.h.scheduler.held) == [held_request(f, held)]
    assert f.h.scheduler.snapshot().waiting_adapters == ("a", "c")
    f.h.post(Cancel(rare.request_id))
    f.step()
    assert f.h.residency.draining == {} and not f.h.scheduler.held
    f.h.run(held, long_a, long_b)
    assert held.events[0] == Started("a") and held.tokens == [7, 9]  # slot 0: still "a"
    assert [i for i, _ in f.h.runner.writes] == [0, 1]


def held_request(f: Flood, collector) -> object:
    return next(r for r in f.h.scheduler.held if r.request_id == collector.request_id)


def test_pinned_slots_are_never_drained() -> None:
    """With "a" pinned (LoadAdapter pin=True) and "b" streaming in the other slot, "c" takes "b"'s slot."""
    from concurrent.futures import Future

    from loraserve.engine.residency import Load

    f = Flood(True)
    pinned = Future()
    f.h.post(Load("a", True, pinned))
    f.step()
    for step in range(10):
        f.submit("ab"[step % 2])
        if step == 4:
            rare = f.submit("c")
        f.step()
    assert rare.done.is_set() and f.h.residency.table.find("a").pinned
    assert [i for i, _ in f.h.runner.writes] == [0, 1, 1, 1]  # a pinned in 0; b, c, b through slot 1
