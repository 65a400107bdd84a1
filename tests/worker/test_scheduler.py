"""The scheduler over the FakeRunner: exact token sequences, cancellation, deadlines, limits, unloads.

FakeRunner tokens: next = (last + slot + 2) % 50, slot -1 for the base model. So prompt [5] gives
6, 7, 8, ... on the base model, 7, 9, 11, ... on slot 0 and 8, 11, 14, ... on slot 1. A request handled
in a step is prefilled and decoded once in that same step (two tokens); a cold adapter is written on the
step after its first request.
"""

from __future__ import annotations

import dataclasses
import hashlib
from concurrent.futures import Future

import grpc
import numpy as np
import pytest

from loraserve.adapters.errors import AdapterDataLossError
from loraserve.common.admission import UNMEASURED_RETRY_S, retry_after
from loraserve.common.errors import FailedPrecondition, LoraserveError, ResourceExhausted
from loraserve.common.slots import SlotState
from loraserve.engine.config import EngineConfig
from loraserve.engine.fake_runner import fake_logprobs
from loraserve.engine.kv_pages import KVCache
from loraserve.engine.request import Failed, Finished, Sampling, SamplingRow, Started, Token, TokenLogprobs
from loraserve.engine.residency import Load, Unload
from loraserve.engine.scheduler import AFTER_CANCEL_BUCKETS, Cancel
from tests.worker.fake_engine import Collector, Harness, adapter_files, source_of

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


def test_logprobs_only_for_requests_that_ask_sliced_to_their_n() -> None:
    h = harness()
    plain = h.submit(max_tokens=3)
    asked = h.submit("a", max_tokens=3, logprobs=2)  # the same batch: prefill and decode steps shared
    h.run(plain, asked)
    assert plain.events == [Started(""), Token(6), Token(7), Finished("length", 1, 3, token_id=8)]

    def lp(token: int) -> TokenLogprobs:
        ids, lps = fake_logprobs(token, 50)
        return TokenLogprobs(lps[0], tuple(ids[:2]), tuple(lps[:2]))

    assert lp(7) == TokenLogprobs(-0.25, (7, 8), (-0.25, -0.5))
    assert asked.events == [
        Started("a"),
        Token(7, lp(7)),
        Token(9, lp(9)),
        Finished("length", 1, 3, token_id=11, logprobs=lp(11)),
    ]


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
    with pytest.raises(ResourceExhausted, match="queue is full") as refused:
        h.submit()
    # nothing has left the queue yet: the unmeasured wait; the same refusal asked before a prompt is read
    assert refused.value.retry_after == UNMEASURED_RETRY_S
    assert h.scheduler.refusal().retry_after == UNMEASURED_RETRY_S
    h.step()  # the first one holds the row: one queued
    third = h.submit(max_tokens=1)
    with pytest.raises(ResourceExhausted) as refused:
        h.submit()
    # one place freed so far: the wait is one place at the measured drain rate
    assert refused.value.retry_after == retry_after(1, h.scheduler.drain.rate())
    assert h.scheduler.drain.rate() > 0
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


# ----------------------------------------------------------------- KV pages (4-token pages, TINY tokens)
def paged(**kw) -> EngineConfig:
    return EngineConfig(
        **{
            "max_batch_size": 2,
            "max_seq_len": 16,
            "max_loras": 2,
            "max_lora_rank": 4,
            "kv_page_size": 4,
            **kw,
        }
    )


def kv_state(h: Harness) -> tuple[int, int, int]:
    """(pages used, cached, free) as the snapshot tells them."""
    s = h.scheduler.snapshot()
    return s.kv_pages_used, s.kv_pages_cached, s.kv_pages_total - s.kv_pages_used - s.kv_pages_cached


def test_pages_follow_admission_decode_growth_and_finish() -> None:
    h = harness(paged())  # 2 rows of 4 pages + the null page
    c = h.submit(prompt=(1, 2, 3, 4, 5, 6), max_tokens=6)
    seen = []
    for _ in range(5):
        h.step()
        seen.append((kv_state(h), h.scheduler.tables[0].tolist()))
    assert seen == [
        ((2, 0, 6), [1, 2, 0, 0]),  # positions 0..5 + the first decode token's (6): 2 pages
        ((2, 0, 6), [1, 2, 0, 0]),
        ((3, 0, 5), [1, 2, 3, 0]),  # position 8 starts page 3
        ((3, 0, 5), [1, 2, 3, 0]),
        ((0, 2, 6), [0, 0, 0, 0]),  # finished: the two full computed pages stay cached
    ]
    assert c.tokens == [7, 8, 9, 10, 11, 12] and h.scheduler.tables.sum() == 0
    assert h.runner.prefills == [(0, -1, (1, 2, 3, 4, 5, 6), (1, 2))]
    snap = h.scheduler.snapshot()
    assert (snap.kv_page_size, snap.kv_pages_total, snap.kv_utilisation) == (4, 8, 0.0)
    # a follow-up turn (prompt + answer + more) hits the page the decode filled, not only the prompt's
    turn = h.submit(prompt=(1, 2, 3, 4, 5, 6, 7, 8, 9), max_tokens=3)
    h.step()
    assert kv_state(h) == (3, 0, 5) and h.scheduler.snapshot().kv_utilisation == 3 / 8
    h.run(turn)
    assert turn.tokens == [10, 11, 12]
    assert h.runner.prefills[-1] == (8, -1, (9,), (1, 2, 4))
    assert h.runner.contexts[-1] == (1, 2, 3, 4, 5, 6, 7, 8, 9)
    snap = h.scheduler.snapshot()
    assert (snap.prefix_hit_tokens, snap.prefix_query_tokens) == (8, 15)


def test_admission_waits_for_pages_in_order_and_reclaims_cached_pages_lru() -> None:
    h = harness(paged(max_batch_size=3, kv_pages=6, prefill_per_step=3))  # 5 usable pages
    first = h.submit(prompt=tuple(range(10)), max_tokens=3)  # 3 pages
    second = h.submit(prompt=tuple(range(20, 30)), max_tokens=2)  # 3 pages: waits
    small = h.submit(prompt=(40,), max_tokens=2)  # 1 page would do, but it does not jump the queue
    h.step()
    assert (first.tokens, second.tokens, small.tokens) == ([10, 11], [], [])
    assert kv_state(h) == (3, 0, 2) and h.scheduler.snapshot().waiting == 2
    h.step()  # first finishes; its 3 pages were full and computed: cached, tail first in LRU order
    assert first.tokens == [10, 11, 12] and kv_state(h) == (0, 3, 2)
    assert h.scheduler.kv.lru_order() == (3, 2, 1)
    h.step()
    assert (second.tokens, small.tokens) == ([30, 31], [41, 42])
    # the free pages (4, 5) first, then cached ones least recently released first (3, then 2)
    assert [p[3] for p in h.runner.prefills] == [(1, 2, 3), (4, 5, 3), (2,)]
    assert h.scheduler.kv.lru_order() == (1, 5, 4) and h.scheduler.queued == 0


def _preempting(kv_pages: int) -> tuple[Harness, Collector, Collector]:
    h = harness(paged(kv_pages=kv_pages))
    return h, h.submit(prompt=(1, 2, 3), max_tokens=12), h.submit("a", prompt=(10, 11, 12), max_tokens=12)


def test_preemption_recomputes_the_newest_request_without_repeating_or_losing_tokens() -> None:
    h, old, new = _preempting(kv_pages=6)  # 5 pages; each request ends up holding 4
    steps: list[int] = []
    prefill = h.runner.prefill_one
    h.runner.prefill_one = lambda *a: steps.append(a[4].step) or prefill(*a)  # SamplingRow.step per prefill
    h.step(6)
    assert (len(old.tokens), len(new.tokens), kv_state(h)) == (7, 6, (5, 0, 0))
    h.step()  # old's position 12 needs a page: none left, so the newest (new, "a") is preempted
    snap = h.scheduler.snapshot()
    assert (snap.preemptions, snap.running, snap.waiting, h.scheduler.queued) == (1, 1, 1, 1)
    assert kv_state(h) == (3, 2, 0) and h.scheduler.tables[1].sum() == 0
    assert snap.slots[0].refcount == 1  # it keeps its adapter slot while it waits
    h.run(old, new)
    assert old.tokens == list(range(4, 16))
    assert new.events[0] == Started("a") and Started("a") not in new.events[1:]
    assert new.tokens == list(range(14, 38, 2)) and new.end == Finished("length", 3, 12, token_id=36)
    # the resume prefills prompt + the 6 tokens streamed, from its first page (still cached) on
    assert h.runner.prefills[1:] == [(0, 0, (10, 11, 12), (2,)), (4, 0, (16, 18, 20, 22, 24), (2, 4, 5))]
    assert h.runner.contexts[-1] == (10, 11, 12, 14, 16, 18, 20, 22, 24)
    assert steps == [0, 0, 6]  # seeded sampling goes on at the step it stopped
    snap = h.scheduler.snapshot()
    assert (snap.preemptions, snap.prefix_hit_tokens, snap.prefix_query_tokens) == (1, 4, 15)
    assert (snap.waiting, h.scheduler.queued, snap.slots[0].refcount, kv_state(h)) == (0, 0, 0, (0, 4, 1))
    # an uninterrupted run (a pool with room for both) streams exactly the same events
    h2, old2, new2 = _preempting(kv_pages=0)
    h2.run(old2, new2)
    assert (old2.events, new2.events, h2.scheduler.snapshot().preemptions) == (old.events, new.events, 0)


def test_a_preempted_request_whose_pages_were_reclaimed_recomputes_everything() -> None:
    h, old, new = _preempting(kv_pages=5)  # 4 pages: the old request takes them all in the end
    h.run(old, new)
    assert old.tokens == list(range(4, 16)) and new.tokens == list(range(14, 38, 2))
    # preempted with 5 tokens streamed; its pages went to the old request: everything is recomputed
    assert h.runner.prefills[-1] == (0, 0, (10, 11, 12, 14, 16, 18, 20, 22), (2, 4, 3))
    assert h.scheduler.snapshot().preemptions == 1


def test_cancelling_a_preempted_request_releases_its_slot_and_queue_place() -> None:
    h, old, new = _preempting(kv_pages=6)
    h.step(7)
    assert h.scheduler.snapshot().preemptions == 1
    h.post(Cancel(new.request_id))
    h.step()
    assert new.end == Failed(grpc.StatusCode.CANCELLED, "cancelled by the client")
    snap = h.scheduler.snapshot()
    assert (snap.waiting, h.scheduler.queued, snap.slots[0].refcount, snap.running) == (0, 0, 0, 1)
    h.run(old)
    assert old.tokens == list(range(4, 16))
    assert kv_state(h) == (0, 4, 1)  # old's 3 full pages and the cancelled one's first page stay cached


def _shared_prefix_run(caching: bool) -> tuple[Harness, list[Collector]]:
    cfg = EngineConfig(
        max_batch_size=4,
        max_seq_len=1024,
        max_loras=1,
        max_lora_rank=4,
        kv_page_size=16,
        enable_prefix_caching=caching,
    )
    h = harness(cfg, "a")
    prefix = [(7 * i) % 49 for i in range(512)]
    reqs = [
        h.submit("a", prompt=[*prefix, *((r + j) % 49 for j in range(8))], max_tokens=4) for r in range(32)
    ]
    h.run(*reqs, limit=200)
    return h, reqs


def test_32_requests_sharing_a_512_token_prefix_compute_it_once() -> None:
    cached, with_cache = _shared_prefix_run(True)
    plain, without = _shared_prefix_run(False)
    computed = sum(len(p[2]) for p in cached.runner.prefills)
    baseline = sum(len(p[2]) for p in plain.runner.prefills)
    assert (computed, baseline) == (520 + 31 * 8, 32 * 520)  # 768 / 16640 = 4.6 %
    assert [c.events for c in with_cache] == [c.events for c in without]
    assert cached.runner.contexts == plain.runner.contexts  # every prefill attended to its whole prompt
    assert [p[0] for p in cached.runner.prefills] == [0] + [512] * 31
    snap, off = cached.scheduler.snapshot(), plain.scheduler.snapshot()
    assert (snap.prefix_hit_tokens, snap.prefix_query_tokens) == (31 * 512, 32 * 520)
    assert (off.prefix_hit_tokens, off.prefix_query_tokens, off.kv_pages_cached) == (0, 0, 0)
    assert snap.kv_pages_cached == 32  # the prefix; each request's last page (8 + 3 tokens) was never full


def test_the_same_prompt_under_two_adapters_and_the_base_shares_nothing() -> None:
    h = harness(paged(max_seq_len=32))
    prompt = tuple(range(1, 21))  # 5 full pages
    for adapter in ("a", "b", "", "a", "b", ""):
        h.run(h.submit(adapter, prompt=prompt, max_tokens=2))
    assert [(p[0], p[1]) for p in h.runner.prefills] == [(0, 0), (0, 1), (0, -1), (16, 0), (16, 1), (16, -1)]
    assert all(c == prompt for c in h.runner.contexts)
    assert h.scheduler.snapshot().prefix_hit_tokens == 3 * 16


def test_an_adapter_reloaded_into_another_slot_still_hits_its_pages() -> None:
    h = harness(paged(max_seq_len=32))
    prompt = tuple(range(1, 21))
    h.run(h.submit("a", prompt=prompt, max_tokens=2))
    unloaded, pinned = Future(), Future()
    h.post(Unload("a", False, unloaded))
    h.post(Load("b", True, pinned))
    h.step(2)
    assert (unloaded.result(0).index, pinned.result(0).index) == (0, 0)
    again = h.submit("a", prompt=prompt, max_tokens=2)
    h.run(again)
    assert again.tokens == [(20 + 1 + 2) % 50, (23 + 3) % 50]  # slot 1 now
    assert [p[:2] for p in h.runner.prefills] == [(0, 0), (16, 1)] and h.runner.contexts[-1] == prompt
    assert h.scheduler.snapshot().prefix_hit_tokens == 16


def test_the_fake_runner_refuses_kv_computed_under_another_adapter_or_never_written() -> None:
    h = harness(paged(max_seq_len=32))
    h.run(h.submit("a", prompt=tuple(range(1, 10)), max_tokens=2))
    table = np.array([1, 2, 3, 0, 0, 0, 0, 0], np.int32)
    row = SamplingRow()
    assert h.runner.prefill_one([9], 8, 0, table, row) == 11  # slot 0 holds "a": its pages 1, 2 are fine
    with pytest.raises(AssertionError, match=r"position 0 holds KV of '[0-9a-f]{64}', attended under 'base'"):
        h.runner.prefill_one([9], 8, -1, table, row)
    with pytest.raises(AssertionError, match=r"position 10 \(page 3\) was never written"):
        h.runner.prefill_one([9], 13, 0, np.array([1, 2, 3, 4, 0, 0, 0, 0], np.int32), row)
    with pytest.raises(AssertionError, match="position 0 is in page 0, not a real page"):
        h.runner.prefill_one([9], 1, 0, np.zeros(8, np.int32), row)


def test_prefix_caching_off_never_hits_and_frees_pages_at_once() -> None:
    h = harness(paged(max_seq_len=32, enable_prefix_caching=False))
    prompt = tuple(range(1, 21))
    for _ in range(2):
        h.run(h.submit("a", prompt=prompt, max_tokens=2))
    assert [p[0] for p in h.runner.prefills] == [0, 0]
    snap = h.scheduler.snapshot()
    assert (snap.prefix_hit_tokens, snap.prefix_query_tokens, kv_state(h)) == (0, 0, (0, 0, 16))


def test_a_request_larger_than_the_pool_fails_instead_of_waiting_forever() -> None:
    h = harness(paged())
    h.scheduler.kv = KVCache(num_pages=3, page_size=4)  # smaller than the config allows: 2 usable pages
    too_big = h.submit(prompt=tuple(range(1, 9)), max_tokens=2)  # positions 0..8: 3 pages
    fits = h.submit(prompt=(1, 2, 3), max_tokens=2)
    h.run(too_big, fits)
    assert too_big.events == [
        Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "the request needs more KV pages than the pool holds")
    ]
    assert fits.tokens == [4, 5] and h.scheduler.queued == 0


def test_prompts_admitted_together_are_prefilled_in_one_call_and_share_a_prefix_computed_in_it() -> None:
    # four requests of one adapter arrive together; the first computes the shared 3 pages, the other
    # three read them in the same packed call (the runner writes every sequence before any attends)
    h = harness(paged(max_batch_size=4, max_seq_len=32, prefill_per_step=4), "a")
    prefix = tuple(range(1, 13))
    reqs = [h.submit("a", prompt=(*prefix, 20 + r), max_tokens=3) for r in range(4)]
    h.run(*reqs)
    assert h.runner.prefill_batches == [4]
    assert [(p[0], len(p[2])) for p in h.runner.prefills] == [(0, 13), (12, 1), (12, 1), (12, 1)]
    assert all(c == (*prefix, 20 + r) for r, c in enumerate(h.runner.contexts))
    assert [r.tokens for r in reqs] == [[20 + r + 2, 20 + r + 4, 20 + r + 6] for r in range(4)]
    assert h.scheduler.snapshot().prefix_hit_tokens == 3 * 12


def test_step_outputs_concatenate_with_and_without_logprobs() -> None:
    """A prefill split over several calls: a call where no row asked has no logprob arrays; the joined
    output keeps every row's own (zeros for rows that did not ask)."""
    from loraserve.engine.runner import StepOutput

    plain = StepOutput(np.array([4, 5], np.int32))
    asked = StepOutput(
        np.array([6], np.int32),
        np.array([-0.5], np.float32),
        np.array([[6, 1, 2]], np.int32),
        np.array([[-0.5, -1.0, -2.0]], np.float32),
    )
    joined = StepOutput.concat([plain, asked, plain.head(1)])
    assert joined.tokens.tolist() == [4, 5, 6, 4]
    assert joined.logprobs(2, 2) == TokenLogprobs(-0.5, (6, 1), (-0.5, -1.0))
    assert joined.logprobs(3, 1) == TokenLogprobs(0.0, (0,), (0.0,))
    assert StepOutput.concat([plain, plain]).logprob is None


def test_a_request_with_logits_controls_has_its_row_history_written_at_admission_and_at_resume() -> None:
    h = harness(paged(kv_pages=6))
    old = h.submit(prompt=(1, 2, 3), max_tokens=12)  # no controls: its row's history is never written
    new = h.submit("a", prompt=(10, 11, 12), max_tokens=12, presence_penalty=0.5, logit_bias=((7, -3.0),))
    h.run(old, new)
    assert h.scheduler.preemptions == 1
    bias = ((7, -3.0, 2**31 - 1),)
    # admitted to row 1 with its prompt; preempted after 6 tokens; resumed in row 0 (the old request's,
    # finished meanwhile) with them counted
    assert h.runner.histories == [
        (1, (10, 11, 12), (), bias),
        (0, (10, 11, 12), (14, 16, 18, 20, 22, 24), bias),
    ]
    assert new.tokens == list(range(14, 38, 2))  # the fake runner ignores the controls


def test_min_tokens_bans_the_stop_tokens_and_eos_for_that_many_steps() -> None:
    s = Sampling(min_tokens=3, stop_token_ids=(9, 4), logit_bias=((5, 1.5),))
    inf, forever = float("-inf"), 2**31 - 1
    assert s.bias_entries((2,)) == [(5, 1.5, forever), (2, inf, 3), (4, inf, 3), (9, inf, 3)]
    assert Sampling(min_tokens=3, ignore_eos=True).bias_entries((2,)) == []
    assert not Sampling(max_tokens=5, stop_token_ids=(1,)).controlled and s.controlled


def _after_cancel(h: Harness) -> tuple[dict[str, int], tuple[int, ...], int]:
    snap = h.scheduler.snapshot()
    return dict(snap.cancelled), snap.after_cancel, snap.after_cancel_tokens


@pytest.mark.parametrize("chained", [False, True], ids=["one step at a time", "async decode"])
def test_a_cancel_costs_at_most_the_step_it_arrives_in(chained: bool) -> None:
    """``loraserve_tokens_after_cancel``: tokens a request takes between its cancel's post (from the servicer's
    thread, while the engine runs a step) and the engine ending it. The step running when the cancel arrives
    gives it at most two: its prefill's first token and its decode token (one step at a time), or one token
    read there and the step dispatched before the cancel's handling, which reads it first (async decode)."""
    h = harness(dataclasses.replace(CFG, async_decode=chained))
    decoding = h.submit(max_tokens=20)
    h.step(3)
    before = len(decoding.tokens)
    cancel = h.scheduler.cancelling(decoding.request_id)  # posted while...
    h.scheduler.step()  # ...the engine runs this step
    h.scheduler.flush()
    h.post(cancel)
    h.step()
    assert decoding.end == Failed(grpc.StatusCode.CANCELLED, "cancelled by the client")
    taken = len(decoding.tokens) - before
    assert taken == (2 if chained else 1)

    fresh = h.submit(max_tokens=20)  # cancelled while its Submit is handled: prefilled and decoded at once
    h.scheduler.handle(h.inbox.pop())
    cancel = h.scheduler.cancelling(fresh.request_id)
    h.scheduler.step()
    h.scheduler.flush()
    h.post(cancel)
    h.step()
    assert fresh.end.code == grpc.StatusCode.CANCELLED and len(fresh.tokens) == 2

    queued = h.submit(max_tokens=20)  # cancelled before it ran: nothing taken
    h.post(h.scheduler.cancelling(queued.request_id, "deadline"))
    h.step()
    assert queued.tokens == []
    finished = h.submit(max_tokens=1)
    h.run(finished)
    h.post(h.scheduler.cancelling(finished.request_id, "stop_string"))  # too late: nothing to cancel
    h.step()
    cancelled, buckets, tokens = _after_cancel(h)
    assert cancelled == {"client": 2, "deadline": 1, "stop_string": 0}
    assert tokens == taken + 2
    assert sum(buckets) == 3 and sum(buckets[: AFTER_CANCEL_BUCKETS.index(2) + 1]) == 3
    assert buckets[0] == 1  # the queued one
    assert h.scheduler._cancelling == {}  # every posted cancel was handled: nothing is kept
    assert h.scheduler.snapshot().running == 0 and h.scheduler.kv.used == 0


def test_the_engines_own_deadline_expiries_count_as_cancelled_by_deadline() -> None:
    h = harness(dataclasses.replace(CFG, max_batch_size=1))
    running = h.submit(max_tokens=20, deadline=5.0)
    queued = h.submit(max_tokens=2, deadline=5.0)
    h.step(2)
    h.now = 5.0
    h.run(running, queued)
    assert _after_cancel(h)[0] == {"client": 0, "deadline": 2, "stop_string": 0}
    assert _after_cancel(h)[1:] == ((0,) * (len(AFTER_CANCEL_BUCKETS) + 1), 0)  # no cancel was posted


def test_the_cancellation_metrics_are_exported_from_the_snapshot() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from loraserve.worker.metrics import EngineCollector

    h = harness()
    a, b = h.submit(max_tokens=20), h.submit(max_tokens=20)
    h.step(2)
    cancel = h.scheduler.cancelling(a.request_id)
    h.scheduler.step()
    h.post(cancel)
    h.post(h.scheduler.cancelling(b.request_id, "stop_string"))
    h.step()

    class Stub:
        def snapshot(self):
            return h.scheduler.snapshot()

    registry = CollectorRegistry()
    registry.register(EngineCollector(Stub()))
    text = generate_latest(registry).decode()
    assert 'loraserve_requests_cancelled_total{reason="client"} 1.0' in text
    assert 'loraserve_requests_cancelled_total{reason="stop_string"} 1.0' in text
    assert 'loraserve_requests_cancelled_total{reason="deadline"} 0.0' in text
    assert 'loraserve_tokens_after_cancel_bucket{le="0.0"} 1.0' in text  # b: posted after the step
    assert 'loraserve_tokens_after_cancel_bucket{le="2.0"} 2.0' in text
    assert 'loraserve_tokens_after_cancel_bucket{le="+Inf"} 2.0' in text
    assert "loraserve_tokens_after_cancel_count 2.0" in text
    assert "loraserve_kv_cache_pages_used 0.0" in text
