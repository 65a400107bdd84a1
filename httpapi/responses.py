"""``GenerateResponse`` streams -> OpenAI response objects: whole completions and SSE chunks.

One ``Choice`` accumulates what a stream said (text, logprobs, finish reason, usage); the builders turn a
chunk or the whole into the JSON shapes of ``/v1/completions`` and ``/v1/chat/completions``.
"""

from __future__ import annotations

import codecs
import json
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loraserve.common.finish_reasons import FinishReason
from loraserve.common.tools import CallStream, parse_calls
from loraserve.protos.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from loraserve.httpapi.schemas import ToolUse

# EOS and stop strings/ids are both "stop" to OpenAI clients.
FINISH = {
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_EOS: FinishReason.STOP,
}


def _bytes(lp: pb.Logprob) -> list[int]:
    return list(lp.token_bytes or lp.token.encode())


def chat_logprobs(entries: list[pb.TokenLogprobs]) -> list[dict[str, Any]]:
    """OpenAI chat ``logprobs.content`` items."""
    return [
        {
            "token": e.chosen.token,
            "logprob": e.chosen.logprob,
            "bytes": _bytes(e.chosen),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t)} for t in e.top],
        }
        for e in entries
    ]


def completion_logprobs(entries: list[pb.TokenLogprobs], offset: int) -> dict[str, Any]:
    """OpenAI (legacy) completions ``logprobs``: parallel lists; ``offset`` is the text length before them.
    An echoed prompt's first token has none (NaN on the wire): null there, as vLLM and OpenAI say it.

    ``top_logprobs`` maps each alternative's token to its logprob: the worker spells a piece of a character
    by its bytes (``bytes:\\xNN``, worker.token_strings), so N alternatives are N keys. ``text_offset`` counts
    the characters the tokens before completed (a character split over tokens counts once, at its end)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # keeps a character's first bytes
    for e in entries:
        first = math.isnan(e.chosen.logprob)
        out["tokens"].append(e.chosen.token)
        out["token_logprobs"].append(None if first else e.chosen.logprob)
        out["top_logprobs"].append(None if first else {t.token: t.logprob for t in e.top})
        out["text_offset"].append(offset)
        offset += len(decoder.decode(bytes(_bytes(e.chosen))))
    return out


def usage_json(prompt: int, completion: int, drafted: int = 0, kept: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; where speculative decoding drafted tokens, its ``completion_tokens_details``
    with OpenAI's names for them (predicted outputs): the drafts kept and rejected."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if drafted:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": kept,
            "rejected_prediction_tokens": drafted - kept,
        }
    return out


@dataclass
class Choice:
    """What one generation streamed so far."""

    text: str = ""
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # echo: the prompt's, first message
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding's drafts for it, and those kept
    accepted_draft_tokens: int = 0
    adapter: str = ""

    def add(self, msg: pb.GenerateResponse) -> None:
        self.text += msg.text
        self.logprobs.extend(msg.logprobs)
        self.prompt_logprobs.extend(msg.prompt_logprobs)
        self.adapter = msg.adapter or self.adapter
        if msg.finish_reason:
            self.finish_reason = FINISH.get(msg.finish_reason, FinishReason.STOP)
            self.prompt_tokens = msg.usage.prompt_tokens
            self.completion_tokens = msg.usage.completion_tokens
            self.draft_tokens = msg.usage.draft_tokens
            self.accepted_draft_tokens = msg.usage.accepted_draft_tokens


@dataclass
class Shape:
    """The per-request constants of every object: id, model, created, what the caller asked for, and for
    an echoing completion each prompt's text as sent (None: its tokens' strings joined)."""

    id: str
    model: str
    chat: bool
    logprobs: bool
    echo: bool = False  # completions: the prompt comes first in the text (and logprobs)
    prompt_texts: tuple[str | None, ...] = ()
    tools: ToolUse | None = None  # chat with tools that may be called: replies are read for calls
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, choices: list[tuple[int, Choice]], usage: tuple[int, ...]) -> dict[str, Any]:
        """The non-streaming response: ``choices`` as (prompt index, what it streamed), in order."""
        out = []
        for index, (prompt, c) in enumerate(choices):
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                finish: str | None = c.finish_reason
                if self.tools is not None:
                    content, calls = parse_calls(c.text, self.tools.names, self.tools.mode, self.tools.named)
                    if calls:
                        message = {
                            "role": "assistant",
                            "content": content,
                            "tool_calls": [call.openai() for call in calls],
                        }
                        finish = "tool_calls"  # the calls are whole (a cut one is content, "length")
                out.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": {"content": chat_logprobs(c.logprobs)} if self.logprobs else None,
                        "finish_reason": finish,
                    }
                )
                continue
            echoed, entries = self._echo(prompt, c.prompt_logprobs)
            out.append(
                {
                    "index": index,
                    "text": echoed + c.text,
                    "logprobs": self._logprobs(entries, c.logprobs, 0, len(echoed))
                    if self.logprobs
                    else None,
                    "finish_reason": c.finish_reason,
                }
            )
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": out, "usage": usage_json(*usage)}

    def call_stream(self) -> CallStream | None:
        """What reads one streamed choice for tool calls (None without tools that may be called)."""
        t = self.tools
        return None if t is None else CallStream(t.names, t.mode, t.named)

    def chunk(
        self,
        msg: pb.GenerateResponse,
        offset: int,
        first: bool,
        index: int = 0,
        prompt: int = 0,
        calls: CallStream | None = None,
    ) -> dict[str, Any]:
        """One SSE chunk for ``msg`` of choice ``index`` (of prompt ``prompt``); ``offset`` is the text length
        that choice streamed before it (completions logprobs); ``calls`` reads a chat choice for tool calls
        (its content goes out as it can, the calls with the last chunk)."""
        finish: str | None = FINISH.get(msg.finish_reason) if msg.finish_reason else None
        if self.chat:
            content, found = msg.text, []
            if calls is not None:
                content = calls.feed(msg.text)
                if msg.finish_reason:
                    rest, found = calls.finish()
                    content += rest
            delta: dict[str, Any] = (
                {"role": "assistant", "content": content} if first else {"content": content}
            )
            if found:
                delta["content"] = content or None
                delta["tool_calls"] = [call.openai(i) for i, call in enumerate(found)]
                finish = "tool_calls"
            logprobs = {"content": chat_logprobs(list(msg.logprobs))} if self.logprobs else None
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            head = self._head("chat.completion.chunk")
        else:
            echoed, entries = self._echo(prompt, list(msg.prompt_logprobs)) if first else ("", [])
            generated = list(msg.logprobs)
            logprobs = (
                self._logprobs(entries, generated, offset, offset + len(echoed)) if self.logprobs else None
            )
            choice = {
                "index": index,
                "text": echoed + msg.text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": None}

    def usage_chunk(self, usage: tuple[int, ...]) -> dict[str, Any]:
        """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_json(*usage)}

    @staticmethod
    def _logprobs(
        prompt: list[pb.TokenLogprobs], generated: list[pb.TokenLogprobs], at: int, generated_at: int
    ) -> dict[str, Any]:
        """Completions ``logprobs`` of an echoed prompt (its offsets from ``at``) and then the generated
        tokens (theirs from ``generated_at``, where the echoed text ends)."""
        out = completion_logprobs(prompt, at)
        for key, values in completion_logprobs(generated, generated_at).items():
            out[key] += values
        return out

    def _echo(self, prompt: int, entries: list[pb.TokenLogprobs]) -> tuple[str, list[pb.TokenLogprobs]]:
        """What an echoing completion of prompt ``prompt`` puts first: its text and logprob entries."""
        if not self.echo:
            return "", []
        text = self.prompt_texts[prompt] if prompt < len(self.prompt_texts) else None
        return (text if text is not None else "".join(e.chosen.token for e in entries)), entries

    def text_before(self, msg: pb.GenerateResponse, prompt: int = 0) -> int:
        """How much text the first chunk of a choice (``msg``) puts before its generated text."""
        return len(self._echo(prompt, list(msg.prompt_logprobs))[0])


def cumulative_logprob(c: Choice) -> float:
    """The summed logprob of a choice's generated tokens (how ``best_of`` ranks candidates)."""
    return sum(e.chosen.logprob for e in c.logprobs)


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or a literal such as ``[DONE]``) and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()
