"""Prompt log-probabilities in the scheduler, over the FakeRunner (no JAX): which positions a prefill scores,
across chunks and preemptions, the prefix cache bypassed for such a request, and ``prompt_only`` (no new
token). FakeRunner scores a target ``x`` as ``fake_logprobs(x)``: x ranked first at -0.25, the next ids
after it. The same against transformers on the JAX runner: tests/worker/test_prompt_logprobs_parity.py."""

from __future__ import annotations

from loraserve.common.finish_reasons import FinishReason
from loraserve.engine.config import EngineConfig
from loraserve.engine.fake_runner import fake_logprobs
from loraserve.engine.request import Finished, Started, TokenLogprobs
from tests.worker.fake_engine import Harness, source_of

PROMPT = tuple(range(1, 12))  # 11 tokens: 10 of them scored (nothing precedes the first)


def harness(**kw) -> Harness:
    base = dict(max_batch_size=2, max_seq_len=32, max_loras=2, max_lora_rank=4, kv_page_size=4)
    return Harness(EngineConfig(**{**base, **kw}), source_of("a"))


def scored(tokens, n: int) -> tuple[TokenLogprobs, ...]:
    """What the fake runner reports for each of ``tokens`` with ``n`` alternatives."""
    out = []
    for t in tokens:
        ids, lps = fake_logprobs(t, 50)
        out.append(TokenLogprobs(-0.25, tuple(ids[:n]), tuple(lps[:n])))
    return tuple(out)


def test_every_prompt_token_after_the_first_is_scored_once_in_order_whole_or_chunked() -> None:
    for chunk in (0, 4, 3):
        h = harness(prefill_chunk=chunk)
        c = h.submit(prompt=PROMPT, max_tokens=2, prompt_logprobs=2)
        plain = h.submit(prompt=PROMPT, max_tokens=2)  # the same batch, asking nothing
        h.run(c, plain)
        assert c.events[0] == Started("", scored(PROMPT[1:], 2)), chunk
        assert plain.events[0] == Started("")
        assert c.tokens == plain.tokens == [12, 13]  # scoring changes nothing of the generation


def test_the_runner_is_asked_for_the_next_prompt_token_at_each_position() -> None:
    h = harness(prefill_chunk=4)
    seen = []
    prefill = h.runner.prefill

    def recording(batch):
        seen.extend((p.start, p.targets) for p in batch)
        return prefill(batch)

    h.runner.prefill = recording  # type: ignore[method-assign]
    c = h.submit(prompt=PROMPT, max_tokens=1, prompt_logprobs=0)
    h.run(c)
    assert seen == [
        (0, [2, 3, 4, 5]),
        (4, [6, 7, 8, 9]),
        (8, [10, 11, -1]),  # the last position scores no prompt token: it samples the first new one
    ]
    assert c.events[0] == Started("", scored(PROMPT[1:], 0))


def test_a_scoring_request_computes_its_whole_prompt_even_when_its_prefix_is_cached() -> None:
    h = harness()
    first = h.submit(prompt=PROMPT, max_tokens=1)
    h.run(first)
    again = h.submit(prompt=PROMPT, max_tokens=1)
    h.run(again)
    assert h.runner.prefills[-1][0] == 8  # a plain request reads the two cached pages
    scoring = h.submit(prompt=PROMPT, max_tokens=1, prompt_logprobs=1)
    h.run(scoring)
    assert h.runner.prefills[-1][:3] == (0, -1, PROMPT)  # every position computed, so every one scored
    assert scoring.events[0] == Started("", scored(PROMPT[1:], 1))
    assert scoring.tokens == first.tokens


def test_prompt_only_finishes_after_the_prefill_with_no_token() -> None:
    h = harness()
    c = h.submit(prompt=PROMPT, max_tokens=5, prompt_logprobs=1, prompt_only=True)
    other = h.submit("a", prompt=(5,), max_tokens=3)
    h.run(c, other)
    assert c.events == [Started("", scored(PROMPT[1:], 1)), Finished(FinishReason.LENGTH, 11, 0)]
    assert other.tokens == [7, 9, 11]  # its row (slot 0) decoded as ever beside it
    snap = h.scheduler.snapshot()
    assert (snap.running, snap.waiting, snap.kv_pages_used) == (0, 0, 0)
    bare = h.submit(prompt=(3, 4), prompt_only=True)  # nothing to score: just the count
    h.run(bare)
    assert bare.events == [Started(""), Finished(FinishReason.LENGTH, 2, 0)]


def test_a_request_preempted_while_its_prompt_is_chunked_is_scored_once_from_the_start() -> None:
    # 5 pages of 4 tokens for two rows, 2-token chunks: the running row's growth preempts the newcomer
    # after its second chunk; resumed later, it is scored from position 0 again
    h = harness(max_seq_len=16, prefill_chunk=2, kv_cache_bytes=6)
    long = h.submit(prompt=(7,) * 7, max_tokens=8, ignore_eos=True)
    h.step(7)
    prompt = tuple(range(1, 8))
    scoring = h.submit(prompt=prompt, max_tokens=2, prompt_logprobs=1)
    h.run(long, scoring)
    assert h.scheduler.preemptions == 1
    assert [p[0] for p in h.runner.prefills if p[2][0] in (1, 3, 5)] == [0, 2, 0, 2, 4]  # its chunks' starts
    assert [e for e in scoring.events if isinstance(e, Started)] == [Started("", scored(prompt[1:], 1))]
    assert scoring.tokens == [8, 9]
