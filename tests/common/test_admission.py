"""common/admission.py: the drain rate a refusal's wait comes from, the wait itself, and what a router learns
from its workers' refusals (marks that lift when one of its streams there ends, capacities that age), and the
router's queue (places given first come first served, per worker)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from loraserve.common.admission import (
    MAX_RETRY_S,
    MIN_RETRY_S,
    UNMEASURED_RETRY_S,
    DrainRate,
    FullWorkers,
    WaitQueue,
    retry_after,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_drain_rate_counts_the_last_window_and_forgets_older_events() -> None:
    clock = Clock()
    rate = DrainRate(window=10.0, clock=clock)
    assert rate.rate() == 0.0
    rate.note()
    assert rate.rate() == 1.0  # one event, at least a second of span
    for _ in range(19):
        clock.now += 0.25
        rate.note()
    assert rate.rate() == pytest.approx(20 / 4.75)  # 20 events since the first, 4.75 s ago
    clock.now += 20.0
    rate.note(3)
    assert rate.rate() == pytest.approx(3 / 10.0)  # the older ones left the window
    clock.now += 10.0
    assert rate.rate() == 0.0


def test_the_drain_rate_takes_notes_from_threads() -> None:
    rate = DrainRate(window=60.0)
    threads = [threading.Thread(target=lambda: [rate.note() for _ in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rate.rate() == 4000.0  # every note counted, within its first second


def test_the_wait_is_the_time_the_requests_ahead_take_to_leave() -> None:
    assert retry_after(1, 0.0) == UNMEASURED_RETRY_S  # nothing left yet: no rate to divide by
    assert retry_after(10, 4.0) == 2.5
    assert retry_after(0, 4.0) == 0.25  # at least one place must free
    assert retry_after(1, 1000.0) == MIN_RETRY_S  # never less: the next try would be refused again
    assert retry_after(10_000, 0.5) == MAX_RETRY_S


def test_a_worker_that_refused_is_full_until_one_of_the_routers_streams_there_ends() -> None:
    clock = Clock()
    full = FullWorkers(max_memory=1.0, learned_for=10.0, clock=clock)
    assert full.hint("w1", 5) is None and full.all_full({}, ["w1"]) is None
    full.refused("w1", 4, 0.2)  # it refused while this router had 4 streams there
    assert full.hint("w1", 4) == 0.2  # its own announced wait
    assert full.all_full({"w1": 4}, ["w1"]) == 0.2
    assert full.all_full({"w1": 4, "w2": 0}, ["w1", "w2"]) is None  # w2 was never refused: tried
    assert full.hint("w1", 3) is None  # one of ours ended: a place is free, the mark is gone
    assert full.hint("w1", 4) is None
    full.refused("w1", 4, None)  # a refusal without a wait: the shortest one
    assert full.hint("w1", 9) == MIN_RETRY_S
    clock.now += 1.01  # other routers' streams end unseen: a mark lasts max_memory at most
    assert full.hint("w1", 9) is None


def test_the_capacity_learned_from_refusals_sums_over_workers_and_ages() -> None:
    clock = Clock()
    full = FullWorkers(max_memory=1.0, learned_for=10.0, clock=clock)
    assert full.capacity(["w1"]) is None and full.capacity([]) is None
    full.refused("w1", 24, 0.1)
    assert full.capacity(["w1"]) == 24
    assert full.capacity(["w1", "w2"]) is None  # w2's room is unknown
    full.refused("w2", 8, 0.1)
    clock.now += 5.0
    assert full.capacity(["w1", "w2"]) == 32  # outlives the marks (1 s): what each worker took
    clock.now += 5.5
    assert full.capacity(["w1", "w2"]) is None  # older than learned_for: probe again
    full.refused("w3", 0, 0.1)  # full of other routers' streams: no share of ours learned
    assert full.capacity(["w3"]) is None and full.hint("w3", 0) == 0.1


def test_the_queue_gives_a_freed_place_to_the_oldest_waiter_for_that_worker() -> None:
    async def scenario() -> None:
        queue = WaitQueue(limit=3)
        first, second = queue.join(["a", "b"]), queue.join(["b"])
        third = queue.join(["a"])
        assert (len(queue), queue.has_room(), queue.first() is first) == (3, False, True)
        assert queue.ahead(["b"]) and queue.ahead(["a"]) and not queue.ahead(["c"])
        assert queue.wake("c") is None  # nobody waits for c
        assert queue.wake("b") is first  # the oldest that may go to b
        assert await first.wait(0) and first.place == "b"
        assert queue.wake("b") is second and queue.wake("b") is None  # the first already has a place
        assert not await third.wait(0.01)  # no place for it: the time passes
        assert queue.ahead(["a"]) and not queue.ahead(["b"])  # only the third still waits, for a
        again = queue.join(["a"], front=True)  # refused upstream: first in line again
        assert queue.first() is again and queue.wake("a") is again
        for w in (first, second, third, again):
            queue.leave(w)
        queue.leave(first)  # twice: nothing happens
        assert (len(queue), queue.first()) == (0, None)

    asyncio.run(scenario())
