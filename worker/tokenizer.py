"""The base model's tokenizer, loaded with ``transformers`` from the checkpoint folder (local or fsspec)."""

from __future__ import annotations

import tempfile
from typing import Any

import fsspec

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
)


def load_tokenizer(url: str) -> Any | None:
    """A ``PreTrainedTokenizerFast`` for the checkpoint at ``url``; None when it ships no tokenizer."""
    from transformers import AutoTokenizer

    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if not fs.exists(f"{root}/tokenizer.json") and not fs.exists(f"{root}/tokenizer.model"):
        return None
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return AutoTokenizer.from_pretrained(root)
    tmp = tempfile.mkdtemp(prefix="loraserve-tokenizer-")
    for name in TOKENIZER_FILES:
        if fs.exists(f"{root}/{name}"):
            fs.get(f"{root}/{name}", f"{tmp}/{name}")
    return AutoTokenizer.from_pretrained(tmp)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Prompt text -> token ids, with the special tokens (BOS) the model expects."""
    return list(tokenizer(text)["input_ids"])
