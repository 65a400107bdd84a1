"""Incremental detokenisation never splits a UTF-8 character; stop strings cut text exactly."""

from __future__ import annotations

import grpc
import pytest

from loraserve.engine.request import Failed, Finished, Started, Token, TokenLogprobs
from loraserve.testing import build_tokenizer
from loraserve.worker.detokenize import Detokenizer, StreamAssembler


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_multibyte_characters_are_emitted_whole(tokenizer) -> None:
    text = "ab 東京 🙂 café"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > len(text.split())  # byte-level pieces: some characters span several tokens
    detok = Detokenizer(tokenizer, [])
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    # at least one token completed no character on its own (a split character waited for the next token)
    assert "" in deltas


def test_prompt_context_does_not_leak_into_output(tokenizer) -> None:
    prompt = tokenizer("Colors: red green")["input_ids"]
    gen = tokenizer(" blue")["input_ids"]
    detok = Detokenizer(tokenizer, prompt)
    assert "".join(detok.add(t) for t in gen) + detok.flush() == " blue"


def _run(tokenizer, text, stop, finish="length"):
    ids = tokenizer(text)["input_ids"]
    asm = StreamAssembler(tokenizer, [1, 2], tuple(stop))
    chunks = asm.feed(Started("a@1"))
    for t in ids[:-1]:
        chunks += asm.feed(Token(t))
        if asm.done:
            break
    if not asm.done:
        chunks += asm.feed(Finished(finish, 2, len(ids), token_id=ids[-1]))
    return chunks, asm


def test_stop_string_cuts_before_match_and_holds_back_prefixes(tokenizer) -> None:
    chunks, asm = _run(tokenizer, "one two three four five", ["three"])
    assert "".join(c.text for c in chunks) == "one two "
    assert chunks[-1].finish_reason == "stop" and asm.stopped_by_string
    assert all("thr" not in c.text for c in chunks)
    assert chunks[-1].completion_tokens == sum(len(c.token_ids) for c in chunks)
    assert {c.adapter for c in chunks} == {"a@1"}


def test_logprobs_travel_with_their_token_ids_through_hold_back_and_stop(tokenizer) -> None:
    """Text is held back (a possible stop-string prefix, half a character); token ids and their logprobs
    never are: every chunk's logprobs are those of its own ids, up to the stop."""
    text = "one 東京 two three four"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def lp(i: int) -> TokenLogprobs:
        return TokenLogprobs(-float(i), (ids[i],), (-float(i),))

    asm = StreamAssembler(tokenizer, [1, 2], ("three", "tw"))
    chunks = asm.feed(Started(""))
    for i, t in enumerate(ids[:-1]):
        chunks += asm.feed(Token(t, lp(i)))
        if asm.done:
            break
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == "one 東京 "
    assert any(c.text == "" for c in chunks)  # some chunk's text was held back ...
    for c in chunks:
        assert len(c.logprobs) == len(c.token_ids) == 1  # ... but never its token or its logprobs
        assert c.logprobs[0].top_ids == tuple(c.token_ids)
    got = [t for c in chunks for t in c.token_ids]
    assert got == ids[: len(got)] and [c.logprobs[0] for c in chunks] == [lp(i) for i in range(len(got))]
    # the last token, carried by Finished, brings its logprobs; without logprobs chunks carry none
    asm = StreamAssembler(tokenizer, [1], ())
    (last,) = asm.feed(Finished("length", 1, 1, token_id=ids[0], logprobs=lp(0)))
    assert last.logprobs == [lp(0)]
    assert StreamAssembler(tokenizer, [1], ()).feed(Token(ids[0]))[0].logprobs == []


def test_no_stop_match_flushes_everything(tokenizer) -> None:
    chunks, asm = _run(tokenizer, "one two three", ["xyz", "thre3"])
    assert "".join(c.text for c in chunks) == "one two three"
    assert chunks[-1].finish_reason == "length" and not asm.stopped_by_string
    assert chunks[-1].prompt_tokens == 2


def test_failure_ends_the_stream(tokenizer) -> None:
    asm = StreamAssembler(tokenizer, [1], ())
    assert asm.feed(Failed(grpc.StatusCode.NOT_FOUND, "gone")) == []
    assert asm.done and asm.error == Failed(grpc.StatusCode.NOT_FOUND, "gone")
