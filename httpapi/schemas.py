"""OpenAI request bodies (completions and chat completions) and their translation to ``GenerateRequest``.

Fields follow OpenAI's API reference plus vLLM's extensions (``top_k``, ``ignore_eos``, ``stop_token_ids``).
Unknown fields are refused, as OpenAI refuses them, so a typo never silently changes what is generated;
fields OpenAI defines that loraserve does not implement are accepted only at their neutral value
(``presence_penalty=0``, ``n=1``, ``echo=false``...) and refused with a message naming them otherwise.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from loraserve.adapters.refs import parse_ref
from loraserve.common.errors import InvalidArgument, LoraserveError, NotFound
from loraserve.common.limits import (
    INT32_MAX,
    MAX_CONTENT_PARTS,
    MAX_JSON_KEYS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_PROMPT_TOKENS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    UINT32_MAX,
    check_ref,
)
from loraserve.protos.v1 import inference_pb2 as pb

ROLES = ("system", "developer", "user", "assistant", "tool")
# uint32 max: "as many as fit"; the worker caps max_tokens by the context left after the prompt.
UNLIMITED = UINT32_MAX
PROMPT_SHAPES = "prompt must be a string, a list of token ids, or a one-element list of either"
# Every integer that reaches the proto is bounded by its field's type (token ids: int32, counts: uint32), so
# that an out-of-range value is a 400 naming the field, never protobuf's ValueError (500).
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
MaxTokens = Annotated[int, Field(ge=1, le=UINT32_MAX)]


def _token_ids(ids: list[Any]) -> list[int]:
    if len(ids) > MAX_PROMPT_TOKENS:
        raise ValueError(f"prompt has {len(ids)} token ids; at most {MAX_PROMPT_TOKENS}")
    for t in ids:
        if type(t) is not int:
            raise ValueError(f"{PROMPT_SHAPES} (token ids are integers, got {type(t).__name__})")
        if not 0 <= t <= INT32_MAX:
            raise ValueError(f"prompt token id {t} is out of range [0, {INT32_MAX}]")
    return ids


def one_prompt(value: Any) -> str | list[int]:
    """OpenAI's ``prompt`` shapes -> the one prompt loraserve serves (a string or token ids); a ValueError
    naming the shape, the number of prompts, or the first token id out of range."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(PROMPT_SHAPES)
    if value and isinstance(value[0], str | list):  # a list of prompts
        if len(value) != 1:
            raise ValueError(f"prompt holds {len(value)} prompts; send one prompt per request")
        value = value[0]
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(PROMPT_SHAPES)
    return _token_ids(value)


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
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None  # vLLM: -1 or 0 = off
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    n: int = 1
    user: Annotated[str, Field(max_length=256)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_JSON_KEYS)] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_count(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(v)}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is None:
            return None
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        long = [len(s) for s in stops if len(s) > MAX_STOP_CHARS]
        if long:
            raise ValueError(f"a stop sequence is {long[0]} characters; at most {MAX_STOP_CHARS}")
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
    prompt: str | list[int]  # OpenAI's shapes, see one_prompt
    echo: bool = False  # (before max_tokens: its check reads it)
    # OpenAI's default for completions; 0 (with echo): the prompt alone, scored (vLLM's form of lm-eval's)
    max_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        return one_prompt(v)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and not info.data.get("echo"):
            raise ValueError("must be >= 1 (0 returns the prompt alone: it needs echo=true)")
        return v

    @model_validator(mode="after")
    def _completion_only(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported (only 1)")
        return self

    def single_prompt(self) -> str | list[int]:
        if not self.prompt:
            raise InvalidArgument("prompt is empty")
        return self.prompt

    def to_grpc(self, adapter: str, request_id: str) -> pb.GenerateRequest:
        prompt = self.single_prompt()
        req = pb.GenerateRequest(
            request_id=request_id,
            adapter=adapter,
            sampling=self.sampling(self.max_tokens or None, self.logprobs),
            routing_key=self.user or "",
        )
        if self.echo and (self.logprobs is not None or not isinstance(prompt, str)):
            # the prompt's logprobs (and token strings: a prompt of token ids is echoed as their text)
            req.sampling.prompt_logprobs = self.logprobs or 0
        req.sampling.prompt_only = self.max_tokens == 0
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

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"content has {len(v)} parts; at most {MAX_CONTENT_PARTS}")
        return v

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
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
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
        check_ref(model)
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
