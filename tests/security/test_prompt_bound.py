"""The worker's bound on prompt text (``worker.tokenizer.PromptBound``): it never refuses text that fits (every
token covers at most ``max_token_bytes`` bytes, on any text), it knows which tokenizers it cannot bound, and the
fast tokenising path gives exactly what ``tokenizer(text)`` gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.common.errors import InvalidArgument
from loraserve.testing import CORPUS, build_tokenizer
from loraserve.worker.tokenizer import (
    PromptBound,
    _keeps_every_byte,
    _shrink,
    apply_chat,
    encode,
    load_tokenizer,
)

texts = (
    st.text(st.characters(codec="utf-8"), max_size=300)
    | st.sampled_from(CORPUS)
    | st.builds(
        lambda s, n: s * n,
        st.sampled_from([" ", "\n", "ab", "🙂", "Ünï ", "<s>", "----"]),
        st.integers(1, 200),
    )
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("bound-tokenizer")
    build_tokenizer(path)
    return load_tokenizer(str(path))


@settings(max_examples=100, deadline=None)
@given(text=texts)
def test_no_token_covers_more_bytes_than_the_bound(tokenizer, text) -> None:
    bound = PromptBound.of(tokenizer)
    assert bound is not None and bound.shrink == 1
    ids = encode(tokenizer, text)
    assert ids == list(tokenizer(text)["input_ids"])  # the Rust fast path is the transformers path
    body = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(text.encode()) <= len(body) * bound.max_token_bytes
    # so the bound refuses only what cannot fit: a context of len(ids) + 1 tokens holds this text
    bound.check(text, len(ids) + 1)
    assert encode(tokenizer, text, len(ids) + 1, bound) == ids
    if len(ids) > 1:
        with pytest.raises(InvalidArgument, match="context"):
            encode(tokenizer, text, len(ids), bound)


def test_the_bound_refuses_before_tokenising(tokenizer) -> None:
    bound = PromptBound.of(tokenizer)
    limit = bound.limit(100)
    with pytest.raises(InvalidArgument, match=f"over {limit} bytes cannot fit"):
        bound.check_chars(limit + 1, 100)
    bound.check("x" * limit, 100)
    with pytest.raises(InvalidArgument, match=f"prompt is {limit + 1} bytes"):  # "é": 1 character, 2 bytes
        bound.check("é" + "x" * (limit - 1), 100)


def test_chat_is_bounded_once_rendered(tokenizer) -> None:
    bound = PromptBound.of(tokenizer)
    ids = apply_chat(tokenizer, [("user", "hello there")], 512, bound)
    want = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], add_generation_prompt=True, tokenize=True
    )
    assert ids == list(want["input_ids"] if hasattr(want, "keys") else want)
    with pytest.raises(InvalidArgument, match="bytes"):
        apply_chat(tokenizer, [("user", "x" * 100_000)], 64, bound)


@pytest.mark.parametrize(
    "normalizer,factor",
    [
        (None, 1),
        ({"type": "NFC"}, 4),
        (
            {
                "type": "Sequence",
                "normalizers": [
                    {"type": "Prepend", "prepend": "▁"},
                    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
                ],
            },
            1,
        ),
        ({"type": "Replace", "pattern": {"String": "  "}, "content": " "}, 2),
        ({"type": "Replace", "pattern": {"String": " "}, "content": ""}, None),
        ({"type": "Replace", "pattern": {"Regex": r"\s+"}, "content": " "}, None),
        ({"type": "Strip", "strip_left": True, "strip_right": True}, None),
        ({"type": "BertNormalizer"}, None),
        ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "StripAccents"}]}, None),
    ],
)
def test_how_much_a_normaliser_may_shorten_text(normalizer, factor) -> None:
    assert _shrink(normalizer) == factor


@pytest.mark.parametrize(
    "spec,keeps",
    [
        ({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel"}}, True),
        ({"model": {"type": "BPE", "byte_fallback": True}, "pre_tokenizer": {"type": "Metaspace"}}, True),
        ({"model": {"type": "Unigram", "byte_fallback": True}}, True),
        ({"model": {"type": "BPE", "unk_token": "<unk>"}, "pre_tokenizer": {"type": "Metaspace"}}, False),
        ({"model": {"type": "WordPiece"}, "pre_tokenizer": {"type": "BertPreTokenizer"}}, False),
        (
            {
                "model": {"type": "BPE"},
                "pre_tokenizer": {
                    "type": "Sequence",
                    "pretokenizers": [{"type": "Split", "behavior": "Removed"}, {"type": "ByteLevel"}],
                },
            },
            False,
        ),
        (
            {
                "model": {"type": "BPE"},
                "pre_tokenizer": {"type": "ByteLevel"},
                "added_tokens": [{"content": "<|end|>", "rstrip": True}],
            },
            False,
        ),
    ],
)
def test_which_tokenizers_keep_every_byte(spec, keeps) -> None:
    assert _keeps_every_byte(spec) == keeps


def test_no_tokenizer_or_an_unusual_one_has_no_bound() -> None:
    assert PromptBound.of(object()) is None

    class Broken:
        class backend_tokenizer:
            @staticmethod
            def to_str() -> str:
                return "not json"

    assert PromptBound.of(Broken()) is None


def test_the_rust_path_only_where_it_is_what_transformers_does(tokenizer) -> None:
    from loraserve.worker.tokenizer import _plain

    backend = tokenizer.backend_tokenizer
    assert _plain(tokenizer, backend)

    class Infilling(type(tokenizer)):
        def _encode_plus(self, *args, **kwargs):  # a model's own encoding (CodeLlama's <FILL_ME>)
            return super()._encode_plus(*args, **kwargs)

    assert not _plain(Infilling.__new__(Infilling), backend)
    backend.encode_special_tokens = True  # the Python side says no: its path, which syncs the flag
    try:
        assert not _plain(tokenizer, backend)
        assert encode(tokenizer, "<s>hi</s>") == list(tokenizer("<s>hi</s>")["input_ids"])
        assert _plain(tokenizer, backend)
    finally:
        backend.encode_special_tokens = False
