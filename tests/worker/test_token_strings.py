"""worker.token_strings: single tokens as strings and true bytes (byte-level BPE), cached per id."""

from __future__ import annotations

import pytest

from loraserve.testing import build_tokenizer
from loraserve.worker.token_strings import TokenStrings, byte_decoder, is_byte_level


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_byte_alphabet_is_a_bijection_onto_bytes() -> None:
    table = byte_decoder()
    assert sorted(table.values()) == list(range(256))
    assert table["A"] == ord("A") and table["Ġ"] == ord(" ")  # GPT-2's stand-in for a space


def test_token_bytes_add_up_to_the_text_even_mid_character(tokenizer) -> None:
    assert is_byte_level(tokenizer)
    strings = TokenStrings(tokenizer)
    text = "ab 東京 🙂 café naïve"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [strings.get(i) for i in ids]
    assert b"".join(b for _, b in pieces) == text.encode()
    decoded = [tokenizer.decode([i]) for i in ids]
    # a token that holds part of a character decodes to U+FFFD: its bytes are the true ones, and its string
    # spells them (vLLM's form), so no two such tokens share a spelling; every other string is its decoding
    split = [(s, b) for (s, b), d in zip(pieces, decoded, strict=True) if "\ufffd" in d]
    assert split and all(s == "bytes:" + "".join(f"\\x{x:02x}" for x in b) for s, b in split)
    assert len({s for s, _ in split}) == len({b for _, b in split})
    assert [s for (s, _), d in zip(pieces, decoded, strict=True) if "\ufffd" not in d] == [
        d for d in decoded if "\ufffd" not in d
    ]
    assert strings.get(ids[0]) is strings.get(ids[0])  # cached


def test_special_tokens_and_no_tokenizer(tokenizer) -> None:
    strings = TokenStrings(tokenizer)
    eos = tokenizer.eos_token_id
    assert strings.get(eos) == ("</s>", b"</s>")
    assert TokenStrings(None).get(7) == ("", b"")
