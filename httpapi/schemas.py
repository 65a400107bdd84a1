"""OpenAI request bodies (completions and chat completions) and their translation to ``GenerateRequest``.

Fields follow OpenAI's API reference plus vLLM's extensions (``top_k``, ``ignore_eos``, ``stop_token_ids``).
Unknown fields are refused, as OpenAI refuses them, so a typo never silently changes what is generated;
fields OpenAI defines that loraserve does not implement are accepted only at their neutral value
(``presence_penalty=0``, ``n=1``, ``echo=false``...) and refused with a message naming them otherwise.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loraserve.adapters.refs import parse_ref
from loraserve.common.errors import InvalidArgument, LoraserveError, NotFound
from loraserve.protos.v1 import inference_pb2 as pb

MAX_LOGPROBS = 20
MAX_STOP = 16
ROLES = ("system", "developer", "user", "assistant", "tool")
# uint32 max: "as many as fit"; the worker caps max_tokens by the context left after the prompt.
UNLIMITED = 2**32 - 1


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=False)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, usage comes with the last chunk only


class _Common(Strict):
    """Fields shared by both endpoints."""

    model: Annotated[str, Field(min_length=1, max_length=512)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM: -1 or 0 = off
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    n: int = 1
    user: Annotated[str, Field(max_length=256)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is None:
            return None
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _unsupported(self):
        if self.n != 1:
            raise ValueError(f"n={self.n}: loraserve returns one choice per request (n must be 1)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise ValueError(f"{name} is not supported (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> pb.SamplingParams:
        params = pb.SamplingParams(
            max_tokens=UNLIMITED if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,  # OpenAI's default
            top_p=self.top_p or 0.0,
            top_k=max(self.top_k or 0, 0),
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
        )
        if self.seed is not None:
            params.seed = self.seed % 2**64  # negative seeds (allowed by OpenAI) wrap, deterministically
        if logprobs is not None:
            params.logprobs = logprobs
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_only(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported (only 1)")
        return self

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise InvalidArgument(f"prompt holds {len(p)} prompts; send one prompt per request")
            p = p[0]
        if not p:
            raise InvalidArgument("prompt is empty")
        return p

    def to_grpc(self, adapter: str, request_id: str) -> pb.GenerateRequest:
        prompt = self.single_prompt()
        req = pb.GenerateRequest(
            request_id=request_id,
            adapter=adapter,
            sampling=self.sampling(self.max_tokens, self.logprobs),
            routing_key=self.user or "",
        )
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.tokens.ids.extend(prompt)
        return req


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # OpenAI messages carry optional fields (name, tool_calls, refusal...): keep them, use role + content.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(ROLES)}")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _chat_only(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format other than text is not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice is not supported")
        if all(not m.text() for m in self.messages):
            raise ValueError("messages hold no text")
        return self

    def to_grpc(self, adapter: str, request_id: str) -> pb.GenerateRequest:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        req = pb.GenerateRequest(
            request_id=request_id,
            adapter=adapter,
            sampling=self.sampling(limit, logprobs),
            routing_key=self.user or "",  # a rollout keeps each end user on one version
        )
        req.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.text()) for m in self.messages)
        return req


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def adapter_for_model(model: str, base_ids: set[str]) -> str:
    """OpenAI's ``model`` -> ``GenerateRequest.adapter``: "" for a base model id, else an adapter ref
    ("name", "name@3" or "name@prod"); 404 for anything that is neither (e.g. another server's model name)."""
    if model in base_ids:
        return ""
    try:
        parse_ref(model)
    except LoraserveError:
        bases = ", ".join(sorted(base_ids)) or "none registered"
        raise NotFound(
            f"model {model[:128]!r} does not exist: it is neither a base model ({bases}) nor an adapter name"
        ) from None
    return model


def model_card(model_id: str, created: int, owned_by: str, parent: str | None = None, **extra: Any) -> dict:
    """One OpenAI model object; ``parent`` is the base model of an adapter (vLLM's field)."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": owned_by,
        "root": extra.pop("root", model_id),
        "parent": parent,
        **extra,
    }
