"""The Python SDK: ``Client(target).generate(prompt, adapter=..., **sampling)`` streams chunks.

``target`` is a router (or a single worker): ``host:port``, or ``unix:PATH`` for one serving on a unix-domain
socket (``--listen``). ``AsyncClient`` is the asyncio twin. Both raise
``loraserve.common.errors.LoraserveError`` from ``error_from_rpc``: ``.code`` is the ``grpc.StatusCode``
(docs/design.md §8), ``.message`` the server's message.

    from loraserve.client.sdk import Client
    with Client("127.0.0.1:50071") as c:
        for chunk in c.generate("What is the capital of France?", adapter="geo-expert", max_tokens=32):
            print(chunk.text, end="", flush=True)

``mix={"sql-helper": 0.7, "polite@prod": 0.3}`` (instead of ``adapter``) asks for a weighted mix of adapters,
``Σ w_k · scaling_k · B_k A_k x`` per layer (PEFT's ``add_weighted_adapter(..., combination_type="cat")``);
``chunk.adapter`` then names the resolved versions, ``"sql-helper@2*0.7+polite@5*0.3"``.

``logprobs=N`` (0-20) asks for every token's log-probability and its N most likely alternatives:
``chunk.logprobs`` then holds one ``TokenLogprobs`` per id of ``chunk.token_ids``.

``prompt_logprobs=N`` scores the prompt: the first chunk's ``prompt_logprobs`` holds one ``TokenLogprobs``
per prompt token (the first one's logprob is None: nothing precedes it) and ``prompt_token_ids`` the ids;
``prompt_only=True`` generates nothing (how evaluation harnesses score a choice's log-likelihood)::

    scored = c.complete(context + choice, adapter="geo-expert", prompt_logprobs=0, prompt_only=True)
    loglik = sum(lp.chosen.logprob for lp in scored.prompt_logprobs[len(context):])

Logits controls, per request in the batched step (OpenAI's and vLLM's meanings): ``presence_penalty`` and
``frequency_penalty`` (-2..2), ``repetition_penalty`` (transformers' rule, 0.01..100), ``min_tokens`` (no
end-of-sequence or stop token before that many) and ``logit_bias={token_id: bias}`` (-100..100).

Structured outputs: ``structured=pb.StructuredOutput(json_schema=json.dumps(schema))`` (or ``json_object``,
``regex``, ``choice=pb.Choices(choices=[...])``, ``grammar`` in Lark or GBNF) draws every token from those
the constraint allows; the stream ends with finish reason ``stop`` when the constraint is complete.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import grpc

from loraserve.common.errors import error_from_rpc
from loraserve.common.finish_reasons import FINISH_FROM_PROTO, FinishReason
from loraserve.common.security import aio_channel, channel
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.protos.v1 import inference_pb2_grpc


@dataclass(frozen=True)
class Logprob:
    """A token and its natural-log probability under the model's raw distribution."""

    token_id: int
    logprob: float | None  # None for a prompt's first token: nothing precedes it
    token: str = ""  # the token decoded on its own ("" when the server has no tokenizer)
    token_bytes: bytes = b""  # its bytes (true bytes for byte-level BPE tokenizers)


@dataclass(frozen=True)
class TokenLogprobs:
    """The generated token and the requested number of most likely tokens at its position, most likely first."""

    chosen: Logprob
    top: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class Chunk:
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | Literal[""] = ""  # "" until the last chunk; a str: "length", "stop", "eos"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    adapter: str = ""  # resolved "name@version" (a mix: "a@1*0.7+b@2*0.3")
    request_id: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id when asked for
    prompt_token_ids: list[int] = field(default_factory=list)  # first chunk, with prompt_logprobs/prompt_only
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # first chunk: one per prompt token
    draft_tokens: int = 0  # last chunk: speculative decoding's drafted tokens for the request, and those kept
    accepted_draft_tokens: int = 0


def build_request(
    prompt: str | Sequence[int],
    *,
    adapter: str = "",
    max_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    prompt_only: bool = False,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    min_tokens: int = 0,
    logit_bias: Mapping[int, float] | None = None,
    structured: pb.StructuredOutput | None = None,
    routing_key: str = "",
    mix: Mapping[str, float] | Sequence[tuple[str, float]] = (),
    speculative: str = "",
    num_speculative_tokens: int = 0,
    prediction: str | Sequence[int] = "",
) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        prompt_only=prompt_only,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        min_tokens=min_tokens,
        logit_bias=dict(logit_bias or {}),
    )
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    if structured is not None:
        sampling.structured.CopyFrom(structured)
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    if seed is not None:
        sampling.seed = seed
    if logprobs is not None:
        sampling.logprobs = logprobs
    if speculative or num_speculative_tokens:  # "" / 0: the worker's defaults (docs/speculative.md)
        sampling.speculative.method, sampling.speculative.num_tokens = speculative, num_speculative_tokens
    if isinstance(prediction, str) and prediction:  # the expected answer, drafted from
        sampling.speculative.prediction_text = prediction
    elif not isinstance(prediction, str):
        sampling.speculative.prediction_ids.extend(prediction)
    req = pb.GenerateRequest(
        adapter=adapter, sampling=sampling, request_id=request_id, routing_key=routing_key
    )
    parts = mix.items() if isinstance(mix, Mapping) else mix
    req.mix.extend(pb.MixPart(adapter=name, weight=weight) for name, weight in parts)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.tokens.ids.extend(prompt)
    return req


def _logprob(p: pb.Logprob) -> Logprob:
    return Logprob(p.token_id, None if math.isnan(p.logprob) else p.logprob, p.token, p.token_bytes)


def _token_logprobs(entries) -> list[TokenLogprobs]:
    return [TokenLogprobs(_logprob(t.chosen), tuple(_logprob(x) for x in t.top)) for t in entries]


def to_chunk(r: pb.GenerateResponse) -> Chunk:
    return Chunk(
        text=r.text,
        token_ids=list(r.token_ids),
        finish_reason=FINISH_FROM_PROTO.get(r.finish_reason, ""),
        prompt_tokens=r.usage.prompt_tokens,
        completion_tokens=r.usage.completion_tokens,
        adapter=r.adapter,
        request_id=r.request_id,
        logprobs=_token_logprobs(r.logprobs),
        prompt_token_ids=list(r.prompt_token_ids),
        prompt_logprobs=_token_logprobs(r.prompt_logprobs),
        draft_tokens=r.usage.draft_tokens,
        accepted_draft_tokens=r.usage.accepted_draft_tokens,
    )


class Client:
    """``token``: bearer token; ``tls_ca`` (+ ``tls_cert``/``tls_key`` for mTLS): TLS to the server."""

    def __init__(
        self,
        target: str,
        timeout: float | None = 300.0,
        *,
        token: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
    ) -> None:
        self.channel = channel(target, token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.timeout = timeout

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Iterator[Chunk]:
        """Stream chunks; closing the iterator early cancels the request on the server."""
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout)
        try:
            for r in call:
                yield to_chunk(r)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()

    def complete(self, prompt: str | Sequence[int], **kwargs) -> Chunk:
        """The whole answer as one chunk (text and tokens joined, the last chunk's finish and usage)."""
        chunks = list(self.generate(prompt, **kwargs))
        last = chunks[-1]
        return Chunk(
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            adapter=last.adapter,
            request_id=last.request_id,
            logprobs=[lp for c in chunks for lp in c.logprobs],
            prompt_token_ids=chunks[0].prompt_token_ids,
            prompt_logprobs=chunks[0].prompt_logprobs,
            draft_tokens=last.draft_tokens,
            accepted_draft_tokens=last.accepted_draft_tokens,
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    def __init__(
        self,
        target: str,
        timeout: float | None = 300.0,
        *,
        token: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
    ) -> None:
        self.channel = aio_channel(target, token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.timeout = timeout

    async def generate(self, prompt: str | Sequence[int], **kwargs) -> AsyncIterator[Chunk]:
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout)
        try:
            async for r in call:
                yield to_chunk(r)
        except grpc.RpcError as exc:  # AioRpcError is one
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
