"""The base model's tokenizer, loaded with ``transformers`` from the checkpoint folder (local or fsspec); prompt
text and chat templates turned into token ids off the event loop, after a bound on the text's length.

**The bound.** One token covers at most ``max_token_bytes`` bytes of (normalised) text, the longest token of
the vocabulary, added tokens included; so a prompt of more than ``(context - 1) * max_token_bytes`` bytes
cannot fit in a context of ``context`` tokens and is refused (INVALID_ARGUMENT) without being tokenised: a
15 MB prompt is refused in microseconds instead of tokenised for half a minute. This holds when every byte of
text ends up in some token: byte-level BPE (GPT-2, Llama 3, Qwen) and BPE/Unigram with byte fallback (Llama
2, Mistral, Gemma). A normaliser that may shorten text without deleting any (NFC/NFKC, lowercase, prepend,
replace by a non-empty string) multiplies the bound by the most it can shorten; one that may delete text
(strip, accents, control characters), a pre-tokenizer that drops whitespace, an added token that strips the
whitespace around it, or a model with unknown tokens (WordPiece, BPE without byte fallback) can map any length
of text to few tokens: then there is no bound, and the prompt is tokenised (off the loop, under the 16 MiB
body limit) before its length is known.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from typing import Any

import fsspec

from loraserve.common.offload import OffLoop

log = logging.getLogger("loraserve.worker.tokenizer")

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


# Normalisers that never delete text, and the most each may shorten it (bytes in / bytes out): a character
# of up to 4 bytes becomes at least one of >= 1 byte (NFKC: U+1D400 -> "A"; Lowercase: U+212A -> "k"), and
# canonical composition joins at most 3 characters into one (Hangul jamo, 9 bytes -> 3).
_SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1, "ByteLevel": 1}
_DELETING_PRE_TOKENIZERS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit"}


def _shrink(node: dict | None) -> int | None:
    """The most ``node`` (a tokenizer.json normaliser) shortens text by, or None when it may delete text."""
    if node is None:
        return 1
    kind = node.get("type")
    if kind == "Sequence":
        factor = 1
        for step in node.get("normalizers", []):
            f = _shrink(step)
            if f is None:
                return None
            factor *= f
        return factor if factor <= 64 else None
    if kind == "Replace":
        pattern, content = node.get("pattern", {}).get("String"), node.get("content", "")
        if pattern is None or not content:  # a regex, or a deletion
            return None
        return max(1, -(-len(pattern.encode()) // len(content.encode())))
    return _SHRINK.get(kind)


def _keeps_every_byte(spec: dict) -> bool:
    """Whether every byte of (normalised) text ends up in some token: no added token strips the whitespace
    around it, no pre-tokenizer drops any, and the model has no unknown tokens (byte-level BPE, or byte
    fallback)."""

    def kinds(node: Any) -> list[dict]:
        if not isinstance(node, dict):
            return []
        return [node, *(k for p in node.get("pretokenizers", []) for k in kinds(p))]

    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", [])):
        return False  # such a token swallows the whitespace next to it, however much
    pre = kinds(spec.get("pre_tokenizer"))
    for p in pre:
        if p.get("type") in _DELETING_PRE_TOKENIZERS or str(p.get("behavior", "")).lower() == "removed":
            return False
    model = spec.get("model") or {}
    if model.get("byte_fallback"):
        return True
    return model.get("type") == "BPE" and any(p.get("type") == "ByteLevel" for p in pre)


@dataclass(frozen=True)
class PromptBound:
    """At most ``max_token_bytes`` bytes of text per token, after shortening by at most ``shrink``."""

    max_token_bytes: int
    shrink: int = 1

    @classmethod
    def of(cls, tokenizer: Any) -> PromptBound | None:
        """The bound of a ``transformers`` fast tokenizer (see the module's docstring), or None."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        try:
            spec = json.loads(backend.to_str())
            shrink = _shrink(spec.get("normalizer"))
            if shrink is None or not _keeps_every_byte(spec):
                log.warning(
                    "prompt text of this tokenizer has no length bound before tokenising (its normaliser,"
                    " pre-tokenizer or unknown tokens may drop text): prompts are tokenised in full"
                )
                return None
            # UTF-8 length over-counts byte-level BPE's stand-ins ("Ġ" is 2 bytes for 1) and SentencePiece's
            # "▁" (3 for a space), never under-counts: the bound may be loose, never too tight
            vocab = tokenizer.get_vocab()
            longest = max((len(piece.encode("utf-8", "surrogatepass")) for piece in vocab), default=1)
            return cls(longest, shrink)
        except Exception:  # an unusual tokenizer: tokenise in full rather than refuse what might fit
            log.warning("no prompt length bound for this tokenizer", exc_info=True)
            return None

    def limit(self, context: int) -> int:
        """Bytes of normalised text that ``context - 1`` prompt tokens can hold at most."""
        return max(0, context - 1) * self.max_token_bytes

    def _refuse(self, size: str, context: int) -> None:
        from loraserve.common.errors import InvalidArgument

        limit = self.limit(context) * self.shrink
        raise InvalidArgument(
            f"prompt is {size} of text; this worker's context is {context} tokens and one token of its"
            f" vocabulary covers at most {self.max_token_bytes} bytes, so a prompt over {limit} bytes cannot"
            " fit (prompt + at least 1 new token)"
        )

    def check_chars(self, chars: int, context: int) -> None:
        """The check that needs only ``len(text)`` (a character is at least a byte): for the event loop."""
        if chars > self.limit(context) * self.shrink:
            self._refuse(f"at least {chars} bytes", context)

    def check(self, text: str, context: int) -> None:
        """INVALID_ARGUMENT when ``text`` cannot fit in ``context`` tokens."""
        self.check_chars(len(text), context)
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.limit(context) * self.shrink:
            self._refuse(f"{size} bytes", context)


# tokenising and chat templates run here, never on the event loop nor in its default executor
off_loop = OffLoop("loraserve-tokenize")


def _plain(tokenizer: Any, backend: Any) -> bool:
    """Whether ``tokenizer(text)`` is its Rust tokenizer's ``encode_batch`` and nothing more: no encoding
    method of a model's own (CodeLlama's infilling), no truncation or padding set, special tokens split as the
    Python side says (transformers syncs that flag on each call; until it has, take its path)."""
    for name in ("__call__", "_call_one", "encode_plus", "_encode_plus", "_batch_encode_plus"):
        fn = getattr(type(tokenizer), name, None)
        if fn is not None and not getattr(fn, "__module__", "").startswith("transformers.tokenization_utils"):
            return False
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    return (
        backend.truncation is None
        and backend.padding is None
        and bool(getattr(backend, "encode_special_tokens", False)) == split
    )


def _token_ids(tokenizer: Any, text: str, special: bool, context: int) -> list[int]:
    """``tokenizer(text, add_special_tokens=special)["input_ids"]``, through the Rust tokenizer when there is
    one: ``encode_batch_fast`` releases the GIL while it works, keeps no offsets or token strings (freeing
    them holds the GIL: docs/performance.md), and a prompt of ``context`` tokens or more is refused by its
    length, never turned into a Python list (which holds the GIL too)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _plain(tokenizer, backend):
        ids = list(tokenizer(text, add_special_tokens=special)["input_ids"])  # as transformers does it
        n = len(ids)
    else:
        fast = getattr(backend, "encode_batch_fast", backend.encode_batch)  # tokenizers < 0.20: no _fast
        (encoding,) = fast([text], add_special_tokens=special)
        n = len(encoding)
        ids = encoding.ids if not context or n < context else []
    if context and n >= context:
        from loraserve.common.errors import InvalidArgument

        raise InvalidArgument(
            f"prompt has {n} tokens; this worker's context is {context} (prompt + at least 1 new token)"
        )
    return ids


def encode(tokenizer: Any, text: str, context: int = 0, bound: PromptBound | None = None) -> list[int]:
    """Prompt text -> token ids, with the special tokens (BOS) the model expects; with a ``context``, text
    that cannot fit (by its ``bound``, before tokenising; by its tokens, after) is INVALID_ARGUMENT."""
    if bound is not None and context:
        bound.check(text, context)
    return _token_ids(tokenizer, text, True, context)


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Text -> token ids without special tokens (a prediction of the output: a continuation, not a prompt)."""
    return _token_ids(tokenizer, text, False, 0)


def apply_chat(
    tokenizer: Any,
    messages: list[tuple[str, str]] | list[dict[str, Any]],
    context: int = 0,
    bound: PromptBound | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """A conversation -> prompt token ids through the model's chat template, with the generation prompt;
    ``messages`` are (role, content) pairs or Hugging Face's message dicts (tool calls included), ``tools``
    the template's ``tools`` (``common.tools.template_tools``). With a ``bound``, a rendered conversation
    that cannot fit in ``context`` tokens is refused before tokenising (rendering first: a template may drop
    text, e.g. earlier turns' reasoning).

    FAILED_PRECONDITION when the tokenizer ships no chat template (a base model: use completions).
    """
    from loraserve.common.errors import FailedPrecondition, InvalidArgument

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise FailedPrecondition("this model has no chat template: use /v1/completions (a text prompt)")
    if not messages:
        raise InvalidArgument("chat has no messages")
    conversation = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:  # jinja2 TemplateError, raise_exception() in the template: the input's fault
        raise InvalidArgument(f"the chat template refused these messages: {exc}") from exc
    if bound is not None and context:
        bound.check(text, context)
    # what apply_chat_template(tokenize=True) does with the text it renders: no second BOS
    return [int(t) for t in _token_ids(tokenizer, text, False, context)]
