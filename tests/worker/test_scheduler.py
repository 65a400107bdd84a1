"""The scheduler over the FakeRunner: exact token sequences, cancellation, deadlines, limits, unloads.

FakeRunner tokens: next = (last + slot + 2) % 50, slot -1 for the base model. So prompt [5] gives
6, 7, 8, ... on the base model, 7, 9, 11, ... on slot 0 and 8, 11, 14, ... on slot 1. A request handled
in a step is prefilled and decoded once in that same step (two tokens); a cold adapter is written on the
step after its first request.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future

import grpc
import pytest

from loraserve.adapters.errors import AdapterDataLossError
from loraserve.common.errors import FailedPrecondition, LoraserveError, ResourceExhausted
from loraserve.worker.config import EngineConfig
from loraserve.worker.requests import Failed, Finished, Started, Token
from loraserve.worker.residency import Load, Unload
from loraserve.worker.scheduler import Cancel
from loraserve.worker.slot_table import SlotState
from tests.worker.fake_engine import Harness, adapter_files, source_of

CFG = EngineConfig(max_batch_size=2, max_seq_len=32, max_loras=2, max_lora_rank=4, max_cpu_loras=2)


def harness(config: EngineConfig = CFG, *names: str, **errors: Exception) -> Harness:
    return Harness(config, source_of(*(names or ("a", "b", "c")), **errors))


def test_exact_tokens_for_base_and_two_adapter_slots() -> None:
    h = harness()
    base = h.submit(max_tokens=4)
    a = h.submit("a", max_tokens=3)
    b = h.submit("b", prompt=(3, 5), max_tokens=3)
    h.run(base, a, b)
    assert base.events == [Started(""), Token(6), Token(7), Token(8), Finished("length", 1, 4, token_id=9)]
    assert a.events == [Started("a"), Token(7), Token(9), Finished("length", 1, 3, token_id=11)]
    assert b.tokens == [8, 11, 14] and b.end == Finished("length", 2, 3, token_id=14)
    # (start, slot, prompt, page table): each prompt plus its first decode token fits one private page
    assert h.runner.prefills == [(0, -1, (5,), (1,)), (0, 0, (5,), (2,)), (0, 1, (3, 5), (3,))]
    snap = h.scheduler.snapshot()
    assert (snap.tokens_out, snap.requests_done, snap.adapter_loads) == (10, 3, 2)
    assert [(s.index, s.adapter, s.refcount) for s in snap.slots] == [(0, "a", 0), (1, "b", 0)]


def test_eos_stop_and_ignore_eos() -> None:
    h = harness()
    eos = h.submit(prompt=(46,), max_tokens=10)  # 47, 48, 49 = EOS of TINY
    ignored = h.submit(prompt=(46,), max_tokens=5, ignore_eos=True)
    h.run(eos, ignored)
    assert eos.tokens == [47, 48, 49] and eos.end == Finished("eos", 1, 3, token_id=49)
    assert ignored.tokens == [47, 48, 49, 0, 1] and ignored.end.reason == "length"
    stop = h.submit(max_tokens=10, stop_token_ids=(8,))
    h.run(stop)
    assert stop.tokens == [6, 7, 8] and stop.end == Finished("stop", 1, 3, token_id=8)


def test_cancel_while_queued_never_starts_and_frees_its_slot_reference() -> None:
    h = harness(EngineConfig(max_batch_size=1, max_seq_len=32, max_loras=2, max_lora_rank=4))
    running = h.submit(max_tokens=6)
    h.step()
    queued = h.submit("a", max_tokens=3)
    h.step(2)  # "a" is resident and the request holds its slot, waiting for the one row
    assert h.scheduler.snapshot().slots[0].refcount == 1
    h.post(Cancel(queued.request_id))
    h.step()
    assert queued.events == [Failed(grpc.StatusCode.CANCELLED, "cancelled by the client")]
    snap = h.scheduler.snapshot()
    assert snap.slots[0].refcount == 0 and snap.waiting == 0 and h.scheduler.queued == 0
    h.run(running)
    assert running.tokens == [6, 7, 8, 9, 10, 11]


def test_cancel_while_decoding_stops_the_sequence_and_releases() -> None:
    h = harness()
    a = h.submit("a", max_tokens=10)
    h.step(3)  # load, then prefill + 2 decodes
    assert a.tokens == [7, 9, 11]
    h.post(Cancel(a.request_id))
    h.step()
    assert a.events[:-1] == [Started("a"), Token(7), Token(9), Token(11)]
    assert a.end == Failed(grpc.StatusCode.CANCELLED, "cancelled by the client")
    snap = h.scheduler.snapshot()
    assert (snap.running, snap.slots[0].refcount, snap.requests_done) == (0, 0, 1)


def test_unload_refused_while_referenced_then_forced() -> None:
    h = harness()
    a = h.submit("a", max_tokens=20)
    h.step(2)
    refused, forced = Future(), Future()
    h.post(Unload("a", False, refused))
    h.step()
    with pytest.raises(FailedPrecondition, match="adapter a is used by 1 request"):
        refused.result(0)
    h.post(Unload("a", True, forced))
    h.step()
    old = forced.result(0)
    assert (old.index, old.adapter, old.state) == (0, "a", SlotState.LOADED)
    assert a.tokens == [7, 9, 11]  # decoded on after the refused unload; the forced one came first in step 4
    assert a.end == Failed(grpc.StatusCode.UNAVAILABLE, "adapter a was unloaded")
    assert h.runner.zeroed == [0] and h.runner.slot_contents[0] == ""
    assert h.scheduler.snapshot().slots[0].state == SlotState.EMPTY
    missing = Future()
    h.post(Unload("a", False, missing))
    h.step()
    with pytest.raises(LoraserveError, match="not loaded") as exc:
        missing.result(0)
    assert exc.value.code == grpc.StatusCode.NOT_FOUND


def test_lru_eviction_respects_pins() -> None:
    h = harness(CFG, "a", "b", "c", "d")
    pinned = Future()
    h.post(Load("a", True, pinned))
    h.step(2)
    assert pinned.result(0).index == 0 and pinned.result(0).pinned
    for name in ("b", "c", "b", "d"):
        c = h.submit(name, max_tokens=1)
        h.run(c)
        assert c.end == Finished("length", 1, 1, token_id=(5 + h.residency.table.find(name).index + 2) % 50)
    sha = {n: hashlib.sha256(h.source.adapters[n][1]).hexdigest() for n in ("a", "d")}
    # slot 0 keeps the pinned "a"; slot 1 cycles b -> c -> b -> d (nothing else is free)
    assert [i for i, _ in h.runner.writes] == [0, 1, 1, 1, 1]
    assert h.runner.slot_contents == [sha["a"], sha["d"]]
    snap = h.scheduler.snapshot()
    assert [(s.adapter, s.pinned) for s in snap.slots] == [("a", True), ("d", False)]
    assert snap.adapter_loads == 5 and snap.host_tier == ("b", "d")  # max_cpu_loras=2, oldest first


def test_adapters_prepared_in_the_same_step_do_not_evict_each_others_waiters() -> None:
    h = harness(EngineConfig(max_batch_size=4, max_seq_len=32, max_loras=1, max_lora_rank=4), "a", "b")
    a, b = h.submit("a", max_tokens=2), h.submit("b", max_tokens=2)
    h.step(2)  # both prepared; "a" takes the one slot and its request holds it, "b" waits for it
    assert (a.tokens, b.tokens) == ([7, 9], [])
    h.run(a, b)
    assert b.events == [Started("b"), Token(7), Finished("length", 1, 2, token_id=9)]
    assert [i for i, _ in h.runner.writes] == [0, 0] and h.source.fetches == ["a", "b"]


def test_lru_picks_the_least_recently_used_unpinned_slot() -> None:
    h = harness(CFG, "a", "b", "c")
    for name in ("a", "b", "a", "c"):  # "a" used after "b": "b" is the LRU victim for "c"
        c = h.submit(name, max_tokens=1)
        h.run(c)
    assert [(s.index, s.adapter) for s in h.scheduler.snapshot().slots] == [(0, "a"), (1, "c")]


def test_queue_limit_is_resource_exhausted_until_requests_leave() -> None:
    h = harness(EngineConfig(max_batch_size=1, max_seq_len=32, max_loras=2, max_lora_rank=4, max_waiting=2))
    first, second = h.submit(max_tokens=2), h.submit(max_tokens=2)
    with pytest.raises(ResourceExhausted, match="queue is full"):
        h.submit()
    h.step()  # the first one holds the row: one queued
    third = h.submit(max_tokens=1)
    with pytest.raises(ResourceExhausted):
        h.submit()
    h.run(first, second, third)
    assert (first.tokens, second.tokens, third.tokens) == ([6, 7], [6, 7], [6])
    assert h.scheduler.queued == 0


def test_deadline_while_queued_and_while_decoding() -> None:
    h = harness(EngineConfig(max_batch_size=1, max_seq_len=32, max_loras=2, max_lora_rank=4))
    running = h.submit(max_tokens=20, deadline=5.0)
    queued = h.submit("a", max_tokens=2, deadline=2.0)
    h.step(3)
    assert running.tokens == [6, 7, 8, 9]
    assert h.scheduler.snapshot().slots[0].refcount == 1  # "a" is resident; its request waits for the row
    h.now = 2.0
    h.step()
    assert queued.events == [Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")]
    assert running.tokens == [6, 7, 8, 9, 10]
    h.now = 5.0
    h.step()
    assert running.end == Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
    assert running.tokens == [6, 7, 8, 9, 10]
    snap = h.scheduler.snapshot()
    assert (snap.running, snap.waiting, snap.slots[0].refcount, snap.requests_done) == (0, 0, 0, 1)


def test_adapter_that_fails_to_load_fails_only_its_requests() -> None:
    h = harness(CFG, "a", gone=AdapterDataLossError("adapter gone: stored weights do not match their sha256"))
    h.source.adapters["corrupt"] = (adapter_files()[0], b"not safetensors")
    h.source.adapters["wide"] = adapter_files(rank=8)
    base = h.submit(max_tokens=3)
    bad = [h.submit(name, max_tokens=3) for name in ("gone", "corrupt", "wide", "nobody")]
    load = Future()
    h.post(Load("gone", False, load))
    h.run(base, *bad)
    assert base.tokens == [6, 7, 8]
    codes = [(e.end.code, e.events[:-1]) for e in bad]
    assert codes == [
        (grpc.StatusCode.DATA_LOSS, []),
        (grpc.StatusCode.INVALID_ARGUMENT, []),
        (grpc.StatusCode.FAILED_PRECONDITION, []),
        (grpc.StatusCode.NOT_FOUND, []),
    ]
    assert "above the largest slot rank 4" in bad[2].end.message
    assert bad[3].end.message == "adapter 'nobody' is not known to this worker"
    with pytest.raises(LoraserveError, match="stored weights") as exc:
        load.result(0)
    assert exc.value.code == grpc.StatusCode.DATA_LOSS
    snap = h.scheduler.snapshot()
    assert snap.free_slots == 2 and snap.adapter_loads == 0 and snap.waiting == 0


def test_snapshot_names_running_and_waiting_adapters() -> None:
    h = harness(EngineConfig(max_batch_size=1, max_seq_len=32, max_loras=2, max_lora_rank=4))
    a = h.submit("a", max_tokens=5)
    h.submit("b", max_tokens=1)
    h.step(2)
    snap = h.scheduler.snapshot()
    assert (snap.running_adapters, snap.waiting_adapters) == (("a",), ("b",))
    assert (snap.running, snap.waiting, snap.step, snap.free_slots) == (1, 1, 1, 0)
    assert a.tokens == [7, 9]


def test_unknown_commands_fail_loudly() -> None:
    h = harness()
    with pytest.raises(TypeError, match="no command str"):
        h.scheduler.handle("submit")
    with pytest.raises(TypeError, match="no command Cancel"):
        h.residency.handle(Cancel("x"))
