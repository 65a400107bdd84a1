"""The page manager: allocation, release, the adapter-keyed prefix cache, sharing, LRU reclamation; then
under the scheduler with random traffic."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from loraserve.engine.config import EngineConfig
from loraserve.engine.kv_pages import BASE_KEY, KVCache, OutOfPagesError, page_hash
from loraserve.engine.request import Finished, Started
from loraserve.engine.scheduler import CANCELLED, Cancel
from tests.worker.fake_engine import Harness, source_of

A, B = "a" * 64, "b" * 64  # adapter content sha256s


def admit(kv: KVCache, key: str, tokens: list[int], computed: int | None = None):
    """Admit ``tokens`` (+ the first decode token's page) and register what a prefill computed."""
    lookup = kv.lookup(key, tokens, reserve=1)
    seq = kv.admit(key, tokens, lookup)
    kv.register(seq, tokens, len(tokens) if computed is None else computed)
    return seq


def counts(kv: KVCache) -> tuple[int, int, int]:
    return kv.used, kv.free, kv.cached


def test_page_hash_is_the_documented_chain() -> None:
    h0 = page_hash(b"", A, [1, 2, 3, 4])
    body = struct.pack("<I64s4i", 64, A.encode(), 1, 2, 3, 4)
    assert h0 == hashlib.sha256(body).digest()
    assert (
        page_hash(h0, A, [5, 6, 7, 8])
        == hashlib.sha256(h0 + struct.pack("<I64s4i", 64, A.encode(), 5, 6, 7, 8)).digest()
    )
    assert len({h0, page_hash(b"", B, [1, 2, 3, 4]), page_hash(b"", BASE_KEY, [1, 2, 3, 4])}) == 3


def test_allocation_never_hands_out_the_null_page_and_release_frees() -> None:
    kv = KVCache(num_pages=6, page_size=4, enable_prefix_caching=False)
    assert (kv.total, counts(kv)) == (5, (0, 5, 0))
    first = kv.allocate(3)
    assert first == [1, 2, 3] and counts(kv) == (3, 2, 0)
    with pytest.raises(OutOfPagesError, match="3 pages wanted, 2 available"):
        kv.allocate(3)
    assert counts(kv) == (3, 2, 0)  # a refused allocation takes nothing
    assert kv.allocate(2) == [4, 5] and counts(kv) == (5, 0, 0)
    with pytest.raises(ValueError, match="null page"):
        KVCache(num_pages=1, page_size=4)


def test_admission_pages_and_growth_across_page_boundaries() -> None:
    kv = KVCache(num_pages=8, page_size=4)
    seq = admit(kv, A, [1, 2, 3, 4, 5, 6, 7])  # positions 0..7 (7 = first decode token): 2 pages
    assert (seq.pages, len(seq.hashes), counts(kv)) == ([1, 2], 1, (2, 5, 0))
    assert kv.grow(seq, 8) and seq.pages == [1, 2]  # position 7 is in page 2 already
    assert kv.grow(seq, 9) and seq.pages == [1, 2, 3]  # position 8 starts page 3
    assert kv.grow(seq, 20) and seq.pages == [1, 2, 3, 4, 5] and counts(kv) == (5, 2, 0)
    assert not kv.grow(seq, 29) and seq.pages == [1, 2, 3, 4, 5]  # 3 more wanted, 2 left: nothing taken
    kv.release(seq)
    assert (seq.pages, counts(kv)) == ([], (0, 6, 1))  # page 1 was full and computed: cached
    assert kv.lru_order() == (1,)


def test_hits_are_per_adapter_content_and_capped_before_the_last_token() -> None:
    kv = KVCache(num_pages=16, page_size=4)
    tokens = list(range(10))  # pages [0..3] [4..7] full, [8, 9] partial
    first = admit(kv, A, tokens)
    assert first.pages == [1, 2, 3] and len(first.hashes) == 2
    assert (kv.query_tokens, kv.hit_tokens) == (10, 0)
    assert kv.lookup(A, tokens).hit_pages == (1, 2)
    assert kv.lookup(A, tokens[:9]).hit_pages == (1, 2)  # token 8 is recomputed in a private page
    assert kv.lookup(A, tokens[:8]).hit_pages == (1,)  # 8 tokens: the last one (7) is in page 2
    assert kv.lookup(A, tokens[:5]).hit_pages == (1,)
    assert kv.lookup(A, tokens[:4]).hit_pages == ()
    assert kv.lookup(A, [0, 1, 2, 3, 9, 9, 9, 9, 9]).hit_pages == (1,)  # the chain breaks at page 2
    assert kv.lookup(A, [9, 1, 2, 3, 4, 5, 6, 7, 8]).hit_pages == ()  # a miss ends the chain
    assert kv.lookup(B, tokens).hits == 0 and kv.lookup(BASE_KEY, tokens).hits == 0
    second = admit(kv, A, tokens)
    assert second.pages == [1, 2, 4] and second.hit_pages == 2
    assert [kv.refcount(p) for p in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert (kv.query_tokens, kv.hit_tokens) == (20, 8)
    other = admit(kv, B, tokens)
    assert other.pages == [5, 6, 7] and other.hit_pages == 0
    assert counts(kv) == (7, 8, 0)
    kv.release(first)
    assert counts(kv) == (6, 9, 0)  # pages 1, 2 still held by the second sequence; 3 was never full
    kv.release(second)
    assert counts(kv) == (3, 10, 2) and kv.lru_order() == (2, 1)  # a chain's tail is reclaimed first


def test_an_idle_cached_page_is_hit_again_and_counts_against_what_is_reclaimable() -> None:
    kv = KVCache(num_pages=5, page_size=4)
    tokens = list(range(9))
    kv.release(admit(kv, A, tokens))  # pages 1, 2 cached; 3 free again
    assert counts(kv) == (0, 2, 2)
    lookup = kv.lookup(A, tokens, reserve=1)
    assert (lookup.hit_pages, lookup.new_pages) == ((1, 2), 1)
    assert kv.can_take(lookup)
    big = kv.lookup(A, [*tokens, 1, 2, 3, 4], reserve=1)  # 14 positions: 4 pages, 2 hit, 2 new
    assert (big.hits, big.new_pages, kv.available) == (2, 2, 4)
    assert kv.can_take(big)  # 2 free (3, 4) once the idle hits are taken
    kv.allocate(1)
    assert not kv.can_take(big)  # 1 free + 2 cached, but both cached ones are its own hits
    with pytest.raises(OutOfPagesError):
        kv.admit(A, [*tokens, 1, 2, 3, 4], big)


def test_lru_reclaims_the_least_recently_released_cached_page_first() -> None:
    kv = KVCache(num_pages=7, page_size=2)
    x = admit(kv, A, [1, 2, 3, 4, 5])  # pages 1, 2 full; 3 holds 5 and the first decode token
    y = admit(kv, A, [7, 8, 9, 9, 9])
    assert (x.pages, y.pages) == ([1, 2, 3], [4, 5, 6])
    kv.release(x)
    kv.release(y)
    assert kv.lru_order() == (2, 1, 5, 4) and counts(kv) == (0, 2, 4)
    assert kv.allocate(3) == [3, 6, 2]  # free ones first, then the oldest cached page
    assert kv.lru_order() == (1, 5, 4)
    assert kv.lookup(A, [1, 2, 3, 4, 5]).hit_pages == (1,)  # page 2 lost its hash
    assert kv.lookup(A, [7, 8, 9, 9, 9]).hit_pages == (4, 5)
    kv.allocate(1)
    assert kv.lookup(A, [1, 2, 3, 4, 5]).hit_pages == ()
    assert kv.lru_order() == (5, 4)


def test_a_page_computed_twice_stays_private_the_second_time() -> None:
    kv = KVCache(num_pages=8, page_size=2)
    first = kv.admit(A, [1, 2, 3], kv.lookup(A, [1, 2, 3], reserve=1))
    second = kv.admit(A, [1, 2, 3], kv.lookup(A, [1, 2, 3], reserve=1))  # admitted before first registered
    kv.register(first, [1, 2, 3], 3)
    kv.register(second, [1, 2, 3], 3)
    assert first.hashes == second.hashes and (first.pages, second.pages) == ([1, 2], [3, 4])
    assert kv.lookup(A, [1, 2, 3]).hit_pages == (1,)
    kv.release(second)
    assert counts(kv) == (2, 5, 0)  # page 3 holds no hash of its own: free at once
    kv.release(first)
    assert counts(kv) == (0, 6, 1)


def test_prefix_caching_off_hashes_nothing_and_frees_at_once() -> None:
    kv = KVCache(num_pages=8, page_size=2, enable_prefix_caching=False)
    seq = admit(kv, A, [1, 2, 3, 4, 5])
    assert seq.hashes == [] and kv.lookup(A, [1, 2, 3, 4, 5]).hits == 0
    kv.release(seq)
    again = admit(kv, A, [1, 2, 3, 4, 5])
    assert again.hit_pages == 0 and counts(kv) == (3, 4, 0)
    kv.release(again)
    assert counts(kv) == (0, 7, 0) and (kv.query_tokens, kv.hit_tokens) == (0, 0)


# ----------------------------------------------------------------- under the scheduler, random traffic
@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_on_small_pools_streams_exactly_and_returns_every_page(seed: int) -> None:
    """Shared prefixes under three adapters and the base, tiny pools (preemptions), random cancels: every
    stream is the fake's exact arithmetic sequence with one Started, every prefill attended to its own
    prompt (+ streamed tokens), the fake saw no wrong page, and at the end no page is referenced."""
    rnd = random.Random(seed)
    page, seq_len = rnd.choice([1, 2, 3, 4, 8]), rnd.choice([16, 24, 40])
    per_row = -(-seq_len // page)
    cfg = EngineConfig(
        max_batch_size=rnd.choice([1, 2, 3, 4]),
        max_seq_len=seq_len,
        max_loras=2,
        max_lora_rank=4,
        kv_page_size=page,
        kv_pages=per_row + 1 + rnd.choice([0, 1, 3, 10]),
        prefill_per_step=rnd.choice([1, 2, 3]),
        enable_prefix_caching=seed % 4 != 3,
    )
    h = Harness(cfg, source_of("a", "b", "c"))
    stems = [[rnd.randrange(48) for _ in range(seq_len)] for _ in range(3)]
    reqs = []
    for _ in range(200):
        if len(reqs) < 30 and rnd.random() < 0.4:
            n = rnd.randrange(1, seq_len - 1)
            prompt = rnd.choice(stems)[:n]
            c = h.submit(
                rnd.choice(["", "a", "b", "c"]), prompt, max_tokens=rnd.randrange(1, seq_len - n + 1)
            )
            reqs.append((c, prompt))
        if reqs and rnd.random() < 0.03:
            h.post(Cancel(rnd.choice(reqs)[0].request_id))
        h.step()
        kv = h.scheduler.kv
        assert kv.used + kv.free + kv.cached == kv.total
    h.run(*(c for c, _ in reqs), limit=1000)
    assert h.scheduler.kv.used == 0 and h.scheduler.tables.sum() == 0 and h.scheduler.queued == 0
    for c, prompt in reqs:
        assert [type(e) for e in c.events].count(Started) == (0 if c.events == [CANCELLED] else 1)
        if isinstance(c.end, Finished):
            step = (c.tokens[0] - prompt[-1]) % 50  # slot + 2, fixed for the request's life
            assert c.tokens == [(prompt[-1] + step * (k + 1)) % 50 for k in range(len(c.tokens))]
    streams = [(*prompt, *c.tokens) for c, prompt in reqs]
    for context in h.runner.contexts:
        assert any(
            s[: len(context)] == context and len(context) >= len(p)
            for s, (_, p) in zip(streams, reqs, strict=True)
        )
