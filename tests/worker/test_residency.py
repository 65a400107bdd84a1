"""Adapter residency (loads in flight, host tier, pins) and the engine thread over the FakeRunner."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future

import grpc
import pytest

from loraserve.common.errors import NotFound
from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.engine.fake_runner import FakeRunner
from loraserve.engine.request import EngineRequest, Failed, Finished, Sampling, Started, Token
from loraserve.engine.residency import Load, Unload
from tests.worker.fake_engine import TINY, Collector, Harness, MemorySource, source_of


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"max_batch_size": 2, "max_seq_len": 32, "max_loras": 1, "max_lora_rank": 4, **kw})


def test_one_fetch_for_many_waiting_requests() -> None:
    h = Harness(config(max_batch_size=4), source_of("a"))
    requests = [h.submit("a", max_tokens=2) for _ in range(3)]
    h.run(*requests)
    assert h.source.fetches == ["a"]
    assert [c.tokens for c in requests] == [[7, 9]] * 3
    assert h.scheduler.snapshot().adapter_loads == 1


@pytest.mark.parametrize(
    ("capacity", "fetches", "tier"), [(1, ["a", "b", "a"], ("a",)), (2, ["a", "b"], ("b", "a"))]
)
def test_host_tier_serves_evicted_adapters_without_fetching(capacity, fetches, tier) -> None:
    h = Harness(config(max_cpu_loras=capacity), source_of("a", "b"))
    for name in ("a", "b", "a"):
        c = h.submit(name, max_tokens=1)
        h.run(c)
        assert c.end == Finished("length", 1, 1, token_id=7)
    assert h.source.fetches == fetches
    snap = h.scheduler.snapshot()
    assert snap.host_tier == tier and snap.adapter_loads == 3  # every swap writes the slot again


def test_load_of_a_resident_adapter_pins_it_in_the_same_step() -> None:
    h = Harness(config(max_loras=2), source_of("a", "b"))
    first, again = Future(), Future()
    h.post(Load("a", False, first))
    h.step(2)
    assert (first.result(0).index, first.result(0).pinned) == (0, False)
    h.post(Load("a", True, again))
    h.step()
    assert (again.result(0).index, again.result(0).pinned) == (0, True)
    assert h.source.fetches == ["a"] and [i for i, _ in h.runner.writes] == [0]


def _engine(source: MemorySource, **kw) -> tuple[Engine, FakeRunner]:
    cfg = config(**kw)
    runner = FakeRunner.for_config(TINY.vocab_size, cfg)
    engine = Engine(None, cfg, source, runner=runner, model_config=TINY)
    engine.start()
    return engine, runner


def _submit(engine: Engine, adapter: str = "", **sampling) -> Collector:
    c = Collector(uuid.uuid4().hex)
    engine.submit(EngineRequest(c.request_id, adapter, [5], Sampling(**sampling), c))
    return c


def test_engine_thread_publishes_the_snapshot_before_the_events_it_explains() -> None:
    engine, runner = _engine(source_of("a"))
    seen: list[float] = []
    engine.load_observer = seen.append
    try:
        before = engine.snapshot()
        c = _submit(engine, "a", max_tokens=3)
        assert c.done.wait(5)
        snap = engine.snapshot()  # read right after the Finished arrived
        assert c.tokens == [7, 9, 11] and runner.warmed_up
        assert (snap.requests_done - before.requests_done, snap.tokens_out - before.tokens_out) == (1, 3)
        assert (snap.running, snap.waiting, snap.slots[0].refcount, snap.adapter_loads) == (0, 0, 0, 1)
        assert len(seen) == 1 and 0 <= seen[0] < 5  # one adapter prepared, its seconds observed
        assert engine.unload_adapter("a").result(5).adapter == "a"
        assert engine.snapshot().free_slots == 1  # the unload's effect is visible once its future is done
    finally:
        engine.stop()


def test_engine_thread_cancel_while_decoding_and_cold_adapter_delays_only_its_own() -> None:
    source = source_of("a")
    source.gate = threading.Event()  # the loader blocks on "a" until we let it go
    engine, runner = _engine(source)
    try:
        cold = _submit(engine, "a", max_tokens=2)
        base = _submit(engine, max_tokens=4)
        assert base.done.wait(5) and base.tokens == [6, 7, 8, 9]
        assert not cold.done.is_set() and engine.snapshot().waiting_adapters == ("a",)
        source.gate.set()
        assert cold.done.wait(5) and cold.tokens == [7, 9]
        runner.gate = threading.Event()  # hold the next decode step
        long = _submit(engine, max_tokens=20)
        deadline = time.monotonic() + 5
        while len(runner.prefills) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        # prefilled (token 6) into the pool's third page (1 and 2 went back to the end of the free list);
        # now held inside its first decode
        assert runner.prefills[-1] == (0, -1, (5,), (3,))
        engine.cancel(long.request_id)
        runner.gate.set()
        assert long.done.wait(5)
        assert long.events[1:] == [
            Token(6),
            Token(7),
            Failed(grpc.StatusCode.CANCELLED, "cancelled by the client"),
        ]
        snap = engine.snapshot()
        assert (snap.running, snap.kv_pages_used, snap.kv_pages_cached, snap.kv_pages_total) == (0, 0, 0, 4)
    finally:
        engine.stop()


def test_host_side_modules_import_no_jax() -> None:
    code = (
        "import sys\n"
        "import loraserve.engine.engine, loraserve.engine.scheduler, loraserve.engine.residency\n"
        "import loraserve.engine.fake_runner, loraserve.engine.snapshot\n"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_engine_thread_preempts_with_a_tiny_pool_and_resumes_from_the_other_requests_pages() -> None:
    cfg = config(kv_page_size=4, kv_pages=9)  # 8 pages; two 21-position sequences want 6 each
    runner = FakeRunner.for_config(TINY.vocab_size, cfg)
    engine = Engine(None, cfg, source_of("a"), runner=runner, model_config=TINY)
    first, second = _submit(engine, max_tokens=20), _submit(engine, max_tokens=20)  # both in the first batch
    engine.start()
    try:
        assert first.done.wait(5) and second.done.wait(5)
        assert first.events == second.events and first.events[0] == Started("")
        assert first.tokens == list(range(6, 26)) and Started("") not in second.events[1:]
        snap = engine.snapshot()
        assert (snap.preemptions, snap.running, snap.waiting, snap.kv_pages_used) == (1, 0, 0, 0)
        # the second was preempted at position 16 and resumed on the first one's 4 identical full pages
        assert runner.prefills[-1] == (16, -1, (21,), (1, 3, 5, 7, 6))
        assert (snap.prefix_hit_tokens, snap.prefix_query_tokens) == (16, 1 + 1 + 17)
    finally:
        engine.stop()


def test_a_mix_takes_one_slot_and_a_deleted_part_takes_it_down() -> None:
    """A weighted mix loads its parts at once (each kept in the host tier) into ONE slot under its key; a
    forced unload of a part (the registry deleted it) empties the mix's slot and forgets the part's host
    copy, so the next request for the mix fetches the part again; a plain unload of a part held only inside
    a mix is NOT_FOUND and leaves the mix alone."""
    h = Harness(config(max_loras=2, max_cpu_loras=4), source_of("a", "b"))
    mix = "a*0.5+b*-1.0"
    c = h.submit(mix, max_tokens=2)
    h.run(c)
    assert isinstance(c.end, Finished) and sorted(h.source.fetches) == ["a", "b"]
    snap = h.scheduler.snapshot()
    assert [s.adapter for s in snap.slots if s.adapter] == [mix] and sorted(snap.host_tier) == ["a", "b"]
    plain = Future()
    h.post(Unload("a", False, plain))
    h.step()
    with pytest.raises(NotFound):
        plain.result(0)
    forced = Future()
    h.post(Unload("a", True, forced))
    h.step()
    assert forced.result(0).adapter == mix
    snap = h.scheduler.snapshot()
    assert [s.adapter for s in snap.slots if s.adapter] == [] and snap.host_tier == ("b",)
    again = h.submit(mix, max_tokens=1)
    h.run(again)
    assert isinstance(again.end, Finished) and sorted(h.source.fetches) == ["a", "a", "b"]


def test_a_deleted_version_finishes_its_running_requests_and_is_never_served_again() -> None:
    """The registry's delete order (``Unload(deleted=True)``): the request already decoding on the version
    finishes with every token it would have had; from then on no request gets it, alone or in a mix (the
    registry no longer knows it: NOT_FOUND), its host-tier copy is forgotten at once and its slot empties
    with its last request; other adapters are untouched. A load still in flight when the order comes is
    dropped instead of landing in a slot."""
    h = Harness(config(max_batch_size=4, max_loras=3, max_cpu_loras=4), source_of("a", "b"))
    undisturbed = Harness(config(max_batch_size=4, max_loras=3, max_cpu_loras=4), source_of("a", "b"))
    want = undisturbed.submit("a", max_tokens=8)
    undisturbed.run(want)
    running, other = h.submit("a", max_tokens=8), h.submit("b", max_tokens=8)
    h.step(3)
    assert running.tokens and not running.done.is_set()
    order = Future()
    del h.source.adapters["a"]  # deleted in the registry: resolving it again is NOT_FOUND
    h.post(Unload("a", False, order, deleted=True))
    h.step()
    assert order.result(0).adapter == "a"
    assert "a" not in h.scheduler.snapshot().host_tier
    late, mixed = h.submit("a", max_tokens=1), h.submit("a*0.5+b*1.0", max_tokens=1)
    h.run(running, other, late, mixed)
    assert running.end == want.end and running.tokens == want.tokens  # admitted before the order: finished
    assert isinstance(other.end, Finished)
    for c in (late, mixed):
        assert isinstance(c.end, Failed) and c.end.code == grpc.StatusCode.NOT_FOUND, c.end
    snap = h.scheduler.snapshot()
    assert [s.adapter for s in snap.slots if s.adapter] == ["b"]  # emptied with its last request
    assert "a" not in snap.host_tier and h.source.fetches.count("a") == 1

    # a load in flight when the order arrives never reaches a slot
    h.source.adapters["c"] = h.source.adapters["b"]
    h.source.gate = threading.Event()
    waiting = h.submit("c", max_tokens=1)
    loader = threading.Thread(target=h.step)
    loader.start()  # the load of c blocks in fetch (the harness loads on the engine's thread)
    time.sleep(0.05)
    h.post(Unload("c", False, Future(), deleted=True))
    h.source.gate.set()
    loader.join(5)
    h.run(waiting)
    assert isinstance(waiting.end, Failed) and waiting.end.code == grpc.StatusCode.NOT_FOUND
    assert all(s.adapter != "c" for s in h.scheduler.snapshot().slots)


def test_loads_are_bounded_and_dropped_with_their_last_waiter() -> None:
    """At most ``max_loads`` adapters are loading or prepared (each a slot's worth of host arrays); the
    others queue and start in order as those finish. A load whose every waiting request went away
    (cancelled) is dropped: never started when it was queued, discarded on arrival when it was in flight;
    nothing of it reaches a slot."""
    from loraserve.engine.scheduler import Cancel

    h = Harness(config(max_batch_size=4, max_loras=1, max_waiting=8), source_of("a", "b", "c", "d"))
    started: list = []
    h.residency._spawn = lambda fn, ref: started.append((fn, ref))  # loads run when the test says
    assert h.residency.max_loads == 2
    a, b, c, d = (h.submit(name, max_tokens=1) for name in "abcd")
    h.step()
    assert [ref for _, ref in started] == ["a", "b"]  # c and d queue
    h.post(Cancel(c.request_id))
    h.post(Cancel(a.request_id))  # a is in flight: discarded when it arrives
    h.step()
    fn, ref = started[0]
    fn(ref)  # a's load arrives: nobody wants it
    h.step()
    assert [r for _, r in started] == ["a", "b", "d"]  # c was never started
    for fn, ref in started[1:]:
        fn(ref)
    h.run(b, d)
    assert isinstance(b.end, Finished) and isinstance(d.end, Finished)
    assert [e.code for e in (a.end, c.end)] == [grpc.StatusCode.CANCELLED] * 2
    assert len(h.runner.writes) == 2  # b's and d's: a's prepared weights never reached a slot
    assert h.source.fetches == ["a", "b", "d"]


def test_distinct_mixes_leave_bounded_state() -> None:
    """A tenant can send any number of distinct weighted mixes (any weights): what the worker remembers of
    them stays bounded (``MAX_RESOLVED`` refs; slots and the host tier are bounded by config), and a mix still
    in a slot keeps being served from it."""
    from loraserve.engine import residency

    h = Harness(config(max_batch_size=4, max_loras=2, max_cpu_loras=2), source_of("a", "b"))
    limit = residency.MAX_RESOLVED
    residency.MAX_RESOLVED = 8
    try:
        for i in range(40):
            c = h.submit(f"a*{i + 1}+b*1.0", max_tokens=1)
            h.run(c)
            assert isinstance(c.end, Finished)
            assert len(h.residency._resolved) <= 8
    finally:
        residency.MAX_RESOLVED = limit
    assert sorted(h.source.fetches) == ["a", "b"]  # the parts came from the host tier every time after


def test_a_slot_write_the_runner_refuses_fails_that_load_only() -> None:
    """A multi-host runner computes DoRA's scales as it writes the slot and may refuse them then
    (``JaxRunner.write_slot``): that adapter's requests fail with the runner's INVALID_ARGUMENT, the slot is
    free again (the adapter it evicted too: the runner left the slot zeroed), and the next load is served."""
    from loraserve.adapters.errors import AdapterError

    h = Harness(config(), source_of("a", "bad"))
    refuse, write = threading.Event(), h.runner.write_slot

    def write_slot(index: int, values: str) -> None:
        if refuse.is_set():
            h.runner.zeroed.append(index)
            raise AdapterError("slot value dora_scale_qkv of layer 0 is over the bound once scaled; refused")
        write(index, values)

    h.runner.write_slot = write_slot
    first = h.submit("a", max_tokens=1)
    h.run(first)
    refuse.set()
    bad, waiting = h.submit("bad", max_tokens=1), h.submit("bad", max_tokens=1)
    h.run(bad, waiting)
    for c in (bad, waiting):
        assert isinstance(c.end, Failed) and c.end.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "dora_scale_qkv of layer 0 is over the bound" in c.end.message
    snap = h.scheduler.snapshot()
    assert snap.free_slots == 1 and snap.slots[0].adapter == "" and h.runner.zeroed == [0]
    refuse.clear()
    again = h.submit("a", max_tokens=1)
    h.run(again)
    assert again.end == Finished("length", 1, 1, token_id=7)
    assert [i for i, _ in h.runner.writes] == [0, 0]
