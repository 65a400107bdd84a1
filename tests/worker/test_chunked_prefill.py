"""Chunked prefill (``EngineConfig.prefill_chunk``) over the FakeRunner: a long prompt is computed a chunk
per step, the running rows take a decode step between two chunks, and what is streamed is exactly what the
unchunked engine streams. FakeRunner tokens: next = (last + slot + 2) % 50 (slot -1 = base: last + 1); its
``contexts`` record what each prefill saw (cached positions + its own tokens), so a chunk that did not
find the earlier chunks' keys/values in its pages would show here."""

from __future__ import annotations

import grpc
import pytest

from loraserve.engine.config import EngineConfig
from loraserve.engine.request import Failed, Started
from loraserve.engine.scheduler import Cancel
from tests.worker.fake_engine import Harness, source_of

LONG = tuple(range(1, 12))  # 11 prompt tokens


def config(**kw) -> EngineConfig:
    base = dict(max_batch_size=2, max_seq_len=32, max_loras=2, max_lora_rank=4, kv_page_size=4)
    return EngineConfig(**{**base, **kw})


def harness(**kw) -> Harness:
    return Harness(config(**kw), source_of("a", "b"))


def test_a_long_prompt_is_computed_a_chunk_per_step_and_streams_what_the_whole_prompt_streams() -> None:
    chunked, whole = harness(prefill_chunk=4), harness()
    outs = []
    for h in (chunked, whole):
        c = h.submit(prompt=LONG, max_tokens=5)
        h.run(c)
        outs.append(c)
    assert outs[0].events == outs[1].events and outs[0].tokens == [12, 13, 14, 15, 16]
    # (start, slot, tokens, page table): 4 + 4 + 3 tokens, each chunk after the pages of the one before
    assert [p[:3] for p in chunked.runner.prefills] == [
        (0, -1, LONG[:4]),
        (4, -1, LONG[4:8]),
        (8, -1, LONG[8:]),
    ]
    assert chunked.runner.contexts[-1] == LONG  # the last chunk attended over the whole prompt
    assert [p[:3] for p in whole.runner.prefills] == [(0, -1, LONG)]
    # its first token came with the last chunk: two extra steps before it, then the same decode steps
    assert chunked.runner.decode_steps == whole.runner.decode_steps == 4


def test_running_rows_decode_between_two_chunks_of_a_newcomer() -> None:
    h = harness(prefill_chunk=4)
    running = h.submit("a", max_tokens=12)
    h.step(3)  # load "a", then prefill + decode, then decode
    assert running.tokens == [7, 9, 11]
    newcomer = h.submit(prompt=LONG, max_tokens=3)
    h.step()  # the newcomer's first chunk, and the running row's decode step
    assert running.tokens == [7, 9, 11, 13] and newcomer.events == []
    assert h.scheduler.snapshot().running == 2
    h.step()  # second chunk: still nothing streamed for it, one more token for the running row
    assert running.tokens[-1] == 15 and newcomer.events == []
    h.step()  # its last chunk samples its first token; both rows decode
    assert newcomer.events[0] == Started("") and newcomer.tokens == [12, 13]
    assert running.tokens[-1] == 17
    h.run(running, newcomer)
    assert running.tokens == list(range(7, 31, 2)) and newcomer.tokens == [12, 13, 14]


def test_one_token_budget_per_step_is_shared_oldest_first() -> None:
    h = harness(prefill_chunk=6, prefill_per_step=2)
    first = h.submit(prompt=LONG, max_tokens=2)
    second = h.submit(prompt=(40, 41, 42), max_tokens=2)
    h.step()  # 6 of first's 11 tokens use the whole budget: second waits for a later step
    assert [p[:3] for p in h.runner.prefills] == [(0, -1, LONG[:6])]
    h.step()  # first's last 5 tokens, then 1 of second's
    assert [p[:3] for p in h.runner.prefills[1:]] == [(6, -1, LONG[6:]), (0, -1, (40,))]
    assert h.runner.prefill_batches == [1, 2]  # packed into one prefill call per step
    h.run(first, second)
    assert first.tokens == [12, 13] and second.tokens == [43, 44]
    assert h.runner.contexts[-1] == (40, 41, 42)


def test_cancelling_mid_prefill_ends_the_request_and_frees_its_row_and_pages() -> None:
    h = harness(prefill_chunk=4, enable_prefix_caching=False)
    c = h.submit(prompt=LONG, max_tokens=4)
    h.step()
    h.post(Cancel(c.request_id))
    h.step()
    assert c.events == [Failed(grpc.StatusCode.CANCELLED, "cancelled by the client")]
    snap = h.scheduler.snapshot()
    assert (snap.running, snap.kv_pages_used, h.scheduler.rows) == (0, 0, [None, None])
    after = h.submit(prompt=(5,), max_tokens=2)  # the row is free again and nothing half-done leaks
    h.run(after)
    assert after.tokens == [6, 7]


def test_chunks_register_their_pages_for_the_prefix_cache_as_they_are_computed() -> None:
    h = harness(prefill_chunk=4)
    c = h.submit(prompt=LONG, max_tokens=2)
    h.run(c)
    again = h.submit(prompt=LONG, max_tokens=2)
    h.run(again)
    # two full pages (8 tokens) computed by the first run's chunks are hits: only 3 tokens recomputed
    assert h.runner.prefills[-1][:3] == (8, -1, LONG[8:]) and again.tokens == c.tokens
    assert h.runner.contexts[-1] == LONG


def test_the_chunk_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="prefill_chunk"):
        config(prefill_chunk=-1)
