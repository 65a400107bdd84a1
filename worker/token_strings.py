"""Single tokens as text and bytes, for logprobs: ``TokenStrings(tokenizer).get(id) -> (token, token_bytes)``.

``token`` is the id decoded on its own (special tokens kept). ``token_bytes`` is the token's true bytes when
the tokenizer is byte-level BPE (GPT-2 style: its vocabulary spells bytes with printable stand-ins, mapped back
here), else the UTF-8 of ``token``. A token that is part of a multi-byte character decodes to U+FFFD, so many
would share one spelling (and collide as keys of the legacy completions API's top-logprobs dict); such a
token is spelled by its bytes instead, vLLM's form: ``bytes:\\xe6\\x9d`` (lower-case hex, ``\\x`` literally).
Results are cached per id: this runs for every streamed token and every alternative.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any


@cache
def byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's ``bytes_to_unicode``) inverted: stand-in character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    shift = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def _has_byte_level(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("type") == "ByteLevel" or any(_has_byte_level(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_byte_level(v) for v in node)
    return False


def is_byte_level(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (a transformers fast tokenizer) decodes with the byte-level decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return _has_byte_level(json.loads(backend.to_str()).get("decoder"))


class TokenStrings:
    """Per-id ``(token, token_bytes)`` of ``tokenizer`` (None: every token is ``("", b"")``), cached."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.byte_level = tokenizer is not None and is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        if self.tokenizer is None:
            return "", b""
        text = self.tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None and token_id not in self.tokenizer.all_special_ids:
                table = byte_decoder()
                if all(c in table for c in piece):
                    raw = bytes(table[c] for c in piece)
                    return spelled(text, raw), raw
        return text, text.encode("utf-8")


def spelled(text: str, raw: bytes) -> str:
    """``text``, or ``bytes:\\xNN...`` when it shows U+FFFD for bytes that are not U+FFFD's own UTF-8 (a piece
    of a character)."""
    if "\ufffd" not in text or raw == text.encode("utf-8"):
        return text
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
