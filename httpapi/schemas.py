"""OpenAI request bodies (completions and chat completions) and their translation to ``GenerateRequest``.

Fields follow OpenAI's API reference plus vLLM's extensions (``top_k``, ``ignore_eos``, ``stop_token_ids``).
Unknown fields are refused, as OpenAI refuses them, so a typo never silently changes what is generated;
fields OpenAI defines that loraserve does not implement are accepted only at their neutral value
(no ``suffix``...) and refused with a message naming them otherwise.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from loraserve.adapters.refs import parse_ref
from loraserve.common.errors import InvalidArgument, LoraserveError, NotFound
from loraserve.common.limits import (
    INT32_MAX,
    MAX_CHOICES,
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_PENALTY,
    MAX_PREDICTION_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_SEQUENCES,
    MAX_SPECULATIVE_TOKENS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    REPETITION_PENALTY_RANGE,
    UINT32_MAX,
    check_chat,
    check_ref,
)
from loraserve.common.tools import arguments_text, call_schema, check_parameters
from loraserve.protos.v1 import inference_pb2 as pb

ROLES = ("system", "developer", "user", "assistant", "tool")
# uint32 max: "as many as fit"; the worker caps max_tokens by the context left after the prompt.
UNLIMITED = UINT32_MAX
PROMPT_SHAPES = "prompt must be a string, a list of token ids, or a list of either"
# Every integer that reaches the proto is bounded by its field's type (token ids: int32, counts: uint32), so
# that an out-of-range value is a 400 naming the field, never protobuf's ValueError (500).
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
MaxTokens = Annotated[int, Field(ge=1, le=UINT32_MAX)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]


def _token_ids(ids: list[Any]) -> list[int]:
    if len(ids) > MAX_PROMPT_TOKENS:
        raise ValueError(f"prompt has {len(ids)} token ids; at most {MAX_PROMPT_TOKENS}")
    for t in ids:
        if type(t) is not int:
            raise ValueError(f"{PROMPT_SHAPES} (token ids are integers, got {type(t).__name__})")
        if not 0 <= t <= INT32_MAX:
            raise ValueError(f"prompt token id {t} is out of range [0, {INT32_MAX}]")
    return ids


def prompts_of(value: Any) -> list[str | list[int]]:
    """OpenAI's ``prompt`` shapes -> the prompts, each a string or token ids (a string, a list of token ids,
    or a list of either: one choice per prompt); a ValueError naming the shape, the number of prompts, or
    the first token id out of range."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError(PROMPT_SHAPES)
    if not value or not isinstance(value[0], str | list):  # one prompt of token ids
        return [_token_ids(value)]
    if len(value) > MAX_SEQUENCES:
        raise ValueError(f"prompt holds {len(value)} prompts; at most {MAX_SEQUENCES}")
    out: list[str | list[int]] = []
    for item in value:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            out.append(_token_ids(item))
        else:
            raise ValueError(PROMPT_SHAPES)
    return out


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=False)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class SpeculativeOptions(Strict):
    """loraserve's ``speculative`` extra field (GenerateRequest's SamplingParams.speculative)."""

    method: Literal["off", "ngram"] | None = None  # None: the server's --speculative
    num_tokens: Annotated[int, Field(ge=1, le=MAX_SPECULATIVE_TOKENS)] | None = None  # None: the server's


class PredictionPart(Strict):
    type: Literal["text"]
    text: str


class Prediction(Strict):
    """OpenAI's predicted outputs (``prediction``): the text the answer is expected to be, which the worker
    drafts from (speculative decoding; a worker that does not speculate ignores it)."""

    type: Literal["content"]
    content: str | Annotated[list[PredictionPart], Field(max_length=MAX_CONTENT_PARTS)]

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        if len(text) > MAX_PREDICTION_CHARS:
            raise InvalidArgument(f"prediction is {len(text)} characters; at most {MAX_PREDICTION_CHARS}")
        return text


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
    n: Annotated[int, Field(ge=1, le=MAX_SEQUENCES)] = 1
    user: Annotated[str, Field(max_length=256)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: (
        Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])] | None
    ) = None  # vLLM's
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] = 0  # vLLM's
    # token id (a string, as JSON keys are) -> bias; the worker checks the ids against its vocabulary
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # structured outputs: OpenAI's response_format, vLLM's guided_* fields and its newer structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    speculative: SpeculativeOptions | None = None  # loraserve's (docs/speculative.md)
    prediction: Prediction | None = None  # OpenAI's predicted outputs
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

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) <= INT32_MAX):
                raise ValueError(f"logit_bias keys are token ids, got {key[:32]!r}")
            if abs(value) > MAX_LOGIT_BIAS_VALUE:
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], "
                    f"got {value}"
                )
        return v

    def structured(self) -> pb.StructuredOutput | None:
        """The request's constraint, from whichever of the fields names one (at most one may)."""
        found: list[tuple[str, pb.StructuredOutput]] = []
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            found.append(("response_format", _response_format(rf)))
        if self.guided_json is not None:
            found.append(("guided_json", pb.StructuredOutput(json_schema=_schema_text(self.guided_json))))
        if self.guided_regex is not None:
            found.append(("guided_regex", pb.StructuredOutput(regex=self.guided_regex)))
        if self.guided_choice is not None:
            found.append(
                ("guided_choice", pb.StructuredOutput(choice=pb.Choices(choices=self.guided_choice)))
            )
        if self.guided_grammar is not None:
            found.append(("guided_grammar", pb.StructuredOutput(grammar=self.guided_grammar)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", _structured_outputs(self.structured_outputs)))
        if len(found) > 1:
            raise InvalidArgument(f"{' and '.join(n for n, _ in found)} both constrain the output: send one")
        return found[0][1] if found else None

    @model_validator(mode="after")
    def _unsupported(self):
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
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            min_tokens=self.min_tokens,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
        )
        if self.repetition_penalty is not None:
            params.repetition_penalty = self.repetition_penalty
        if self.speculative is not None:
            params.speculative.method = self.speculative.method or ""
            params.speculative.num_tokens = self.speculative.num_tokens or 0
        if self.prediction is not None:
            params.speculative.prediction_text = self.prediction.text()
        structured = self.structured()
        if structured is not None:
            params.structured.CopyFrom(structured)
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise InvalidArgument(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({max_tokens})")
        if self.seed is not None:
            params.seed = self.seed % 2**64  # negative seeds (allowed by OpenAI) wrap, deterministically
        if logprobs is not None:
            params.logprobs = logprobs
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats`` (with ``include_usage``): the usage so far in every chunk."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def candidates(self) -> int:
        """Sequences generated per prompt (``best_of`` where the endpoint has it, else ``n``)."""
        return self.n

    def _sequences(self, base: pb.GenerateRequest, request_id: str) -> list[pb.GenerateRequest]:
        """``base`` once per candidate: its own request id and, with a seed, seed + k (the candidates differ
        and stay reproducible); usage of a greedy request's candidates is the same tokens each."""
        if self.candidates == 1:
            return [base]
        out = []
        for k in range(self.candidates):
            req = pb.GenerateRequest()
            req.CopyFrom(base)
            req.request_id = f"{request_id}-{k}"
            if base.sampling.HasField("seed"):
                req.sampling.seed = (base.sampling.seed + k) % 2**64
            out.append(req)
        return out


class CompletionRequest(_Common):
    prompt: list[str | list[int]]  # OpenAI's shapes, see prompts_of
    echo: bool = False  # (before max_tokens: its check reads it)
    # OpenAI's default for completions; 0 (with echo): the prompt alone, scored (vLLM's form of lm-eval's)
    max_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_SEQUENCES)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> list[str | list[int]]:
        return prompts_of(v)

    @property
    def candidates(self) -> int:
        return self.best_of or self.n

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def echoed_text(self, i: int) -> str | None:
        """Prompt ``i`` as sent when it is text (echo shows it as is); None for token ids."""
        prompt = self.prompt[i]
        return prompt if isinstance(prompt, str) else None

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
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of not in (None, self.n) and self.stream:
            raise ValueError("best_of cannot be streamed (the best are known at the end)")
        if len(self.prompt) * self.candidates > MAX_SEQUENCES:
            raise ValueError(
                f"{len(self.prompt)} prompts x {self.candidates} sequences each is"
                f" {len(self.prompt) * self.candidates} sequences; at most {MAX_SEQUENCES}"
            )
        return self

    def to_grpc(self, adapter: str, request_id: str) -> list[pb.GenerateRequest]:
        """One request per sequence, prompt by prompt (``candidates`` of each)."""
        out = []
        for i, prompt in enumerate(self.prompt):
            if not prompt:
                raise InvalidArgument(f"prompt {i} is empty" if len(self.prompt) > 1 else "prompt is empty")
            logprobs = self.logprobs
            if logprobs is None and self.candidates > self.n:
                logprobs = 0  # best_of ranks the candidates by their tokens' summed logprobs
            req = pb.GenerateRequest(
                request_id=request_id if len(self.prompt) == 1 else f"{request_id}-p{i}",
                adapter=adapter,
                sampling=self.sampling(self.max_tokens or None, logprobs),
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
            out.extend(self._sequences(req, req.request_id))
        return out


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


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and what it asked of them: ``mode`` is ``none``, ``auto``, ``required`` or
    ``named`` (``named`` is then the function)."""

    tools: tuple[pb.Tool, ...]
    mode: str
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    _tool_use: ToolUse | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _chat_only(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if all(not m.text() and not m.model_extra.get("tool_calls") for m in self.messages):
            raise ValueError("messages hold no text")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    def tool_use(self) -> ToolUse:
        """The tools and the tool choice, checked (INVALID_ARGUMENT naming the field)."""
        if self._tool_use is None:
            tools = tuple(_tool(i, t) for i, t in enumerate(self.tools or []))
            mode, named = _tool_choice(self.tool_choice, {t.name for t in tools})
            self._tool_use = ToolUse(tools, mode, named, self.parallel_tool_calls is not False)
        return self._tool_use

    def to_grpc(self, adapter: str, request_id: str) -> list[pb.GenerateRequest]:
        """One request per choice (``n``)."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        req = pb.GenerateRequest(
            request_id=request_id,
            adapter=adapter,
            sampling=self.sampling(limit, logprobs),
            routing_key=self.user or "",  # a rollout keeps each end user on one version
        )
        req.chat.messages.extend(_message(i, m) for i, m in enumerate(self.messages))
        use = self.tool_use()
        req.chat.tools.extend(use.tools)
        check_chat(req.chat)
        if use.forced:
            if req.sampling.HasField("structured"):
                raise InvalidArgument(
                    f"tool_choice {use.mode!r} and a structured output both constrain the output"
                )
            schema = call_schema(use.tools, use.named, use.parallel)
            req.sampling.structured.CopyFrom(pb.StructuredOutput(json_schema=schema))
        return self._sequences(req, request_id)


def _tool(i: int, tool: dict[str, Any]) -> pb.Tool:
    """OpenAI's ``{"type": "function", "function": {name, description, parameters, strict}}`` -> a Tool."""
    where = f"tools[{i}]"
    function = tool.get("function")
    if tool.get("type") != "function" or not isinstance(function, dict):
        raise InvalidArgument(f'{where} must be {{"type": "function", "function": {{...}}}}')
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise InvalidArgument(f"{where}.function has unknown fields: {', '.join(sorted(unknown))[:200]}")
    name, description = function.get("name"), function.get("description") or ""
    if not isinstance(name, str) or not isinstance(description, str):
        raise InvalidArgument(f"{where}.function.name and description must be strings")
    parameters = check_parameters(function.get("parameters"), f"{where}.function.parameters")
    return pb.Tool(name=name, description=description, parameters=json.dumps(parameters))


def _tool_choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    """OpenAI's ``tool_choice`` -> (mode, named function); its default is ``auto`` with tools, else ``none``."""
    if choice is None:
        return ("auto" if names else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not names:
            raise InvalidArgument(f"tool_choice {choice!r} needs tools")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidArgument(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise InvalidArgument(f"tool_choice names {name[:64]!r}, which is not among the tools")
    return "named", name


def _message(i: int, m: ChatMessage) -> pb.ChatMessage:
    """One message -> its proto, with an assistant turn's tool calls and a tool turn's call id."""
    extra = m.model_extra or {}
    out = pb.ChatMessage(role=m.role, content=m.text())
    for key in ("tool_call_id", "name"):
        value = extra.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise InvalidArgument(f"messages[{i}].{key} must be a string")
            setattr(out, key, value)
    calls = extra.get("tool_calls") or []
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise InvalidArgument(f"messages[{i}].tool_calls must be a list of at most {MAX_TOOLS} calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidArgument(
                f'messages[{i}].tool_calls[{j}] must be {{"id", "type": "function", "function": {{name, arguments}}}}'
            )
        args = function.get("arguments", "{}")
        if isinstance(args, dict):
            args = arguments_text(args)
        if not isinstance(args, str):
            raise InvalidArgument(f"messages[{i}].tool_calls[{j}].function.arguments must be JSON text")
        out.tool_calls.add(id=str(call.get("id") or ""), name=function["name"], arguments=args)
    return out


def _schema_text(schema: Any) -> str:
    """A JSON schema given as an object or as JSON text -> JSON text."""
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, dict | bool):
        raise InvalidArgument("a JSON schema must be an object")
    return json.dumps(schema)


def _response_format(rf: dict[str, Any]) -> pb.StructuredOutput:
    """OpenAI's ``response_format``: ``json_object``, or ``json_schema`` with ``json_schema.schema``."""
    kind = rf.get("type")
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidArgument("response_format json_schema needs json_schema.schema")
        return pb.StructuredOutput(json_schema=_schema_text(spec["schema"]))
    raise InvalidArgument(
        f"response_format type must be text, json_object or json_schema, got {str(kind)[:32]!r}"
    )


def _structured_outputs(so: dict[str, Any]) -> pb.StructuredOutput:
    """vLLM's ``structured_outputs``: one of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``."""
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    unknown = set(given) - {"json", "json_object", "regex", "choice", "grammar"}
    if unknown or len(given) != 1:
        raise InvalidArgument(
            "structured_outputs takes exactly one of json, json_object, regex, choice, grammar"
        )
    ((key, value),) = given.items()
    if key == "json":
        return pb.StructuredOutput(json_schema=_schema_text(value))
    if key == "json_object":
        return pb.StructuredOutput(json_object=True)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidArgument("structured_outputs.choice must be a non-empty list of strings")
        if len(value) > MAX_CHOICES:
            raise InvalidArgument(
                f"structured_outputs.choice has {len(value)} strings; at most {MAX_CHOICES}"
            )
        return pb.StructuredOutput(choice=pb.Choices(choices=value))
    if not isinstance(value, str):
        raise InvalidArgument(f"structured_outputs.{key} must be a string")
    return pb.StructuredOutput(**{key: value})


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
