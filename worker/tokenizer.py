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


def apply_chat(tokenizer: Any, messages: list[tuple[str, str]]) -> list[int]:
    """A conversation -> prompt token ids through the model's chat template, with the generation prompt.

    FAILED_PRECONDITION when the tokenizer ships no chat template (a base model: use completions).
    """
    from loraserve.common.errors import FailedPrecondition, InvalidArgument

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise FailedPrecondition("this model has no chat template: use /v1/completions (a text prompt)")
    if not messages:
        raise InvalidArgument("chat has no messages")
    conversation = [{"role": role, "content": content} for role, content in messages]
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # jinja2 TemplateError, raise_exception() in the template: the input's fault
        raise InvalidArgument(f"the chat template refused these messages: {exc}") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]
