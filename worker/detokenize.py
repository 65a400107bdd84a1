"""From engine events to streamed chunks: incremental detokenisation and stop strings.

``Detokenizer`` emits text only once it is complete UTF-8 (a token that ends mid-character waits for
the next one), using the prefix-offset method of TGI/vLLM so that tokenizers which print spaces by
context decode right. ``StreamAssembler`` adds stop strings (text stops before the first match, and
text that may be the start of a stop string is held back until it cannot be) and usage accounting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from loraserve.common.finish_reasons import FinishReason
from loraserve.engine.request import Event, Failed, Finished, Started, Token, TokenLogprobs

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 4  # prompt tokens decoded along with the first new ones, for context-dependent spaces


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is left at the end of the stream (an incomplete character becomes U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


@dataclass
class Chunk:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | Literal[""] = ""  # "" until the last chunk
    prompt_tokens: int = 0
    completion_tokens: int = 0
    adapter: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id when asked, else empty
    # the first chunk of an echoing stream: the prompt's ids, and their logprobs (one per id after the
    # first) when the request asked for them
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


class StreamAssembler:
    """Feeds engine events, returns chunks to send. ``done`` turns True with the last chunk. ``echo``: the
    first chunk carries the prompt's ids and, when the engine scored them, their logprobs. Stop strings are
    not matched while the completion is shorter than ``min_tokens`` (vLLM's rule)."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        stop: tuple[str, ...] = (),
        echo: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.echo: tuple[list[int], tuple[TokenLogprobs, ...]] | None = (
            (list(prompt_ids), ()) if echo else None
        )
        self.detok = Detokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.stop = tuple(s for s in stop if s)
        self.min_tokens = min_tokens
        self.prompt_tokens = len(prompt_ids)
        self.adapter = ""
        self.text = ""  # all text produced so far
        self.sent = 0  # characters of ``text`` already sent
        self.completion_tokens = 0
        self.done = False
        self.stopped_by_string = False
        self.error: Failed | None = None

    def _held_back(self) -> int:
        """Length of the longest suffix of the unsent text that could begin a stop string."""
        tail = self.text[self.sent :]
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(tail)), 0, -1):
                if s.startswith(tail[-n:]):
                    best = max(best, n)
                    break
        return best

    def feed(self, event: Event) -> list[Chunk]:
        chunks = self._feed(event)
        if chunks and self.echo is not None:  # the prompt travels with the first chunk
            chunks[0].prompt_token_ids, chunks[0].prompt_logprobs = self.echo
            self.echo = None
        return chunks

    def _feed(self, event: Event) -> list[Chunk]:
        if self.done:
            return []
        if isinstance(event, Started):
            self.adapter = event.adapter
            if self.echo is not None and event.prompt_logprobs is not None:
                self.echo = (self.echo[0], event.prompt_logprobs)
            return []
        if isinstance(event, Failed):
            self.done, self.error = True, event
            return []
        token_id = event.token_id if isinstance(event, Token | Finished) else None
        lps = [] if token_id is None or event.logprobs is None else [event.logprobs]
        if token_id is not None:
            self.completion_tokens += 1
            if self.detok is not None:
                self.text += self.detok.add(token_id)
            for s in self.stop if self.completion_tokens >= self.min_tokens else ():
                at = self.text.find(s, max(0, self.sent - len(s) + 1))
                if at >= 0:
                    self.text = self.text[:at]
                    self.stopped_by_string = True
                    return [self._last(FinishReason.STOP, [token_id], lps)]
        if isinstance(event, Token):
            upto = len(self.text) - self._held_back()
            chunk = Chunk(
                token_ids=[event.token_id],
                text=self.text[self.sent : upto],
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,  # so far: every chunk says it (GenerateResponse.progress)
                adapter=self.adapter,
                logprobs=lps,
            )
            self.sent = max(self.sent, upto)
            return [chunk]
        assert isinstance(event, Finished)
        if self.detok is not None:
            self.text += self.detok.flush()
        return [self._last(event.reason, [] if token_id is None else [token_id], lps)]

    def _last(self, reason: FinishReason, ids: list[int], logprobs: list[TokenLogprobs]) -> Chunk:
        self.done = True
        chunk = Chunk(
            token_ids=ids,
            text=self.text[self.sent :],
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            adapter=self.adapter,
            logprobs=logprobs,
        )
        self.sent = len(self.text)
        return chunk
