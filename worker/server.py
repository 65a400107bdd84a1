"""The worker's gRPC servicers: ``Inference.Generate`` (streaming), ``WorkerAdmin``, health, reflection.

Thin by design: proto <-> dataclass conversion and status mapping; the engine does the work.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.mixes import MixPart, mix_ref
from loraserve.adapters.sources import LocalAdapterSource
from loraserve.common import admission
from loraserve.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    LoraserveError,
    ResourceExhausted,
    Unavailable,
)
from loraserve.common.finish_reasons import FINISH_TO_PROTO
from loraserve.common.limits import (
    MAX_BODY_BYTES,
    MAX_PREDICTION_TOKENS,
    add_servicer,
    check_generate_request,
    check_ref,
)
from loraserve.common.observability import StreamTimer
from loraserve.common.security import ServerSecurity
from loraserve.common.server import Services, set_health
from loraserve.common.server import build_server as common_build_server
from loraserve.common.tools import template_messages, template_tools
from loraserve.engine.engine import Engine
from loraserve.engine.request import EngineRequest, Sampling, TokenLogprobs
from loraserve.protos.v1 import inference_pb2, inference_pb2_grpc, worker_admin_pb2, worker_admin_pb2_grpc
from loraserve.worker.detokenize import Chunk, StreamAssembler
from loraserve.worker.grammar import Grammars, TokenMatcher
from loraserve.worker.snapshot_messages import slot_info
from loraserve.worker.token_strings import TokenStrings
from loraserve.worker.tokenizer import PromptBound, apply_chat, encode, encode_plain, off_loop

log = logging.getLogger("loraserve.worker.server")

MAX_MESSAGE_BYTES = MAX_BODY_BYTES
ROLES = ("system", "developer", "user", "assistant", "tool")


def sampling_from_proto(p: inference_pb2.SamplingParams) -> Sampling:
    return Sampling(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        prompt_only=p.prompt_only,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        min_tokens=p.min_tokens,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        speculative=p.speculative.method,
        num_speculative_tokens=p.speculative.num_tokens,
    )


def _logprob(strings: TokenStrings, token_id: int, logprob: float) -> inference_pb2.Logprob:
    token, token_bytes = strings.get(token_id)
    return inference_pb2.Logprob(token_id=token_id, logprob=logprob, token=token, token_bytes=token_bytes)


def _token_logprobs(strings: TokenStrings, token_id: int, lp: TokenLogprobs) -> inference_pb2.TokenLogprobs:
    return inference_pb2.TokenLogprobs(
        chosen=_logprob(strings, token_id, lp.logprob),
        top=[_logprob(strings, i, x) for i, x in zip(lp.top_ids, lp.top_logprobs, strict=True)],
    )


def chunk_to_proto(
    request_id: str, chunk: Chunk, strings: TokenStrings | None = None
) -> inference_pb2.GenerateResponse:
    """``strings`` names the tokens of logprobs (None: token ids only, empty token strings)."""
    out = inference_pb2.GenerateResponse(
        request_id=request_id, token_ids=chunk.token_ids, text=chunk.text, adapter=chunk.adapter
    )
    strings = strings or TokenStrings(None)
    if chunk.logprobs:
        pairs = zip(chunk.token_ids, chunk.logprobs, strict=True)
        out.logprobs.extend(_token_logprobs(strings, t, lp) for t, lp in pairs)
    out.prompt_token_ids.extend(chunk.prompt_token_ids)
    if chunk.prompt_logprobs:  # nothing precedes the first prompt token: NaN, no alternatives
        first = chunk.prompt_token_ids[0]
        out.prompt_logprobs.append(inference_pb2.TokenLogprobs(chosen=_logprob(strings, first, math.nan)))
        pairs = zip(chunk.prompt_token_ids[1:], chunk.prompt_logprobs, strict=True)
        out.prompt_logprobs.extend(_token_logprobs(strings, t, lp) for t, lp in pairs)
    out.progress.prompt_tokens = chunk.prompt_tokens
    out.progress.completion_tokens = chunk.completion_tokens
    if chunk.finish_reason:
        out.finish_reason = FINISH_TO_PROTO[chunk.finish_reason]
        out.usage.CopyFrom(out.progress)
    return out


def adapter_of(request: inference_pb2.GenerateRequest) -> str:
    """The engine's adapter ref of a request: ``adapter``, or its ``mix`` as a mix ref (``adapters.mixes``;
    parts and weights are checked when the engine accepts it). INVALID_ARGUMENT when both are set."""
    if not request.mix:
        return request.adapter
    if request.adapter:
        raise InvalidArgument("set adapter or mix, not both")
    return mix_ref([MixPart(p.adapter, p.weight) for p in request.mix])


def _chat_ids(tokenizer: Any, chat: inference_pb2.ChatMessages, context: int, bound: Any) -> list[int]:
    """``apply_chat`` of a request's messages and tools, copied out of the message here (off the loop) too."""
    tools = template_tools(chat.tools) if chat.tools else None
    return apply_chat(tokenizer, template_messages(chat.messages), context, bound, tools)


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on the engine's clock (time.monotonic), or None when the client set none."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _cancel_reason(context: grpc.aio.ServicerContext, stopped_by_string: bool) -> str:
    """Why a stream ended before its request: a stop string, its deadline, else its client went away."""
    if stopped_by_string:
        return "stop_string"
    remaining = context.time_remaining()
    return "deadline" if remaining is not None and remaining <= 0 else "client"


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, engine: Engine, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.token_strings = TokenStrings(tokenizer)  # logprobs' token strings, cached across requests
        # bytes of prompt text a context can hold at most (worker.tokenizer): longer text is never tokenised
        self.bound = PromptBound.of(tokenizer) if tokenizer is not None else None
        self._grammars: Grammars | None = None  # structured outputs' compiler, built on first use (~1 s)
        self._grammars_lock = threading.Lock()

    async def _prompt(self, request: inference_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids. Text and chat are tokenised off the event loop, after the checks that
        need no tokens (``check_generate_request`` has bounded the counts); token ids past the context are
        refused before they are copied."""
        context = self.engine.config.max_seq_len
        kind = request.WhichOneof("prompt")
        if kind == "tokens":
            if len(request.tokens.ids) >= context:
                raise InvalidArgument(
                    f"prompt has {len(request.tokens.ids)} tokens; this worker's context is {context}"
                    " (prompt + at least 1 new token)"
                )
            return list(request.tokens.ids)
        if kind == "chat":
            bad = [m.role for m in request.chat.messages if m.role not in ROLES]
            if bad:
                raise InvalidArgument(
                    f"unknown chat role {bad[0][:32]!r}; expected one of {', '.join(ROLES)}"
                )
            # bounded once rendered (a template may drop text, e.g. earlier turns' reasoning)
            return await off_loop(_chat_ids, self.tokenizer, request.chat, context, self.bound)
        text = request.text if kind == "text" else ""  # one copy out of the message
        if text:
            if self.tokenizer is None:
                raise InvalidArgument("this model has no tokenizer: send token ids")
            if self.bound is not None:
                self.bound.check_chars(len(text), context)  # on the loop: O(1)
            return await off_loop(encode, self.tokenizer, text, context, self.bound)
        raise InvalidArgument("prompt is empty: set text or tokens")

    async def _prediction(self, spec: inference_pb2.Speculative) -> list[int] | None:
        """A request's predicted output as token ids (text tokenised off the event loop, without special
        tokens); None without one. Sizes were bounded by ``check_generate_request``."""
        if spec.prediction_ids:
            return list(spec.prediction_ids)
        if not spec.prediction_text:
            return None
        if self.tokenizer is None:
            raise InvalidArgument("this model has no tokenizer: send the prediction as token ids")
        ids = await off_loop(encode_plain, self.tokenizer, spec.prediction_text)
        if len(ids) > MAX_PREDICTION_TOKENS:
            raise InvalidArgument(f"prediction has {len(ids)} tokens; at most {MAX_PREDICTION_TOKENS}")
        return ids

    def _matcher(self, spec: inference_pb2.StructuredOutput) -> TokenMatcher:
        """A matcher for ``spec`` (on a tokenizer thread: compiling a grammar may take a while)."""
        with self._grammars_lock:
            if self._grammars is None:
                cfg = self.engine.model_config
                self._grammars = Grammars(self.tokenizer, cfg.vocab_size, tuple(cfg.eos_token_ids))
        return self._grammars.matcher(spec)

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        since = admission.arrived()
        check_generate_request(request)  # counts and lengths, before anything is copied or tokenised
        if not self.engine.ready.is_set():
            raise Unavailable("worker is warming up")
        refused = self.engine.refusal()  # a full queue: refused before the prompt is read
        if refused is not None:
            admission.observe("worker", "refused", since)
            raise refused
        request_id = request.request_id or uuid.uuid4().hex
        internal_id = uuid.uuid4().hex  # client ids may repeat; cancellation must not hit a stranger
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        prompt = await self._prompt(request)
        prediction = await self._prediction(request.sampling.speculative)
        grammar = None
        if request.sampling.HasField("structured"):
            if self.tokenizer is None:
                raise FailedPrecondition("this model has no tokenizer: structured outputs need one")
            grammar = await off_loop(self._matcher, request.sampling.structured)
        engine_req = EngineRequest(
            request_id=internal_id,
            adapter=adapter_of(request),
            prompt=prompt,
            sampling=sampling_from_proto(request.sampling),
            sink=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
            deadline=_deadline(context),
            prediction=prediction,
            grammar=grammar,
        )
        try:
            self.engine.submit(engine_req)  # refusals raise LoraserveError: the interceptor maps them
        except ResourceExhausted:
            admission.observe("worker", "refused", since)
            raise
        admission.observe("worker", "admitted", since)
        sampling = engine_req.sampling
        echo = sampling.prompt_logprobs is not None or sampling.prompt_only
        assembler = StreamAssembler(
            self.tokenizer, prompt, tuple(request.sampling.stop), echo, request.sampling.min_tokens
        )
        timer = StreamTimer("worker")
        try:
            while not assembler.done:
                for chunk in assembler.feed(await events.get()):
                    timer.chunk(len(chunk.token_ids))
                    message = chunk_to_proto(request_id, chunk, self.token_strings)
                    if chunk.finish_reason:
                        # drafts: counted by the engine thread, final once the request ended there
                        drafts, kept = engine_req.draft_tokens, engine_req.accepted_draft_tokens
                        message.usage.draft_tokens, message.usage.accepted_draft_tokens = drafts, kept
                        self.engine.accounting.request_done(
                            chunk.adapter, chunk.prompt_tokens, chunk.completion_tokens, drafts, kept
                        )
                    yield message
            if assembler.error is not None:
                raise LoraserveError(assembler.error.message, assembler.error.code)
            timer.done(len(prompt))
            log.info("finished", extra={"request_id": request_id, "adapter": assembler.adapter})
        finally:
            if not engine_req.done or assembler.stopped_by_string:
                self.engine.cancel(internal_id, _cancel_reason(context, assembler.stopped_by_string))


class WorkerAdminServicer(worker_admin_pb2_grpc.WorkerAdminServicer):
    def __init__(self, engine: Engine, model_id: str, worker_id: str = "") -> None:
        self.engine, self.model_id, self.worker_id = engine, model_id, worker_id

    async def LoadAdapter(self, request, context):
        check_ref(request.adapter)  # adapters.refs would take "a@²" for a version and fail in int()
        if request.source_uri:
            if not isinstance(self.engine.source, LocalAdapterSource):
                raise AdapterError("source_uri is only accepted by workers serving local adapters")
            self.engine.source.register(request.adapter, request.source_uri)
        slot = await asyncio.wrap_future(self.engine.load_adapter(request.adapter, request.pin))
        return slot_info(slot)

    async def UnloadAdapter(self, request, context):
        check_ref(request.adapter)
        old = await asyncio.wrap_future(self.engine.unload_adapter(request.adapter, request.force))
        return worker_admin_pb2.UnloadAdapterResponse(slot=old.index, adapter=old.adapter)

    async def ListSlots(self, request, context):
        return worker_admin_pb2.ListSlotsResponse(slots=[slot_info(s) for s in self.engine.snapshot().slots])

    async def GetWorkerInfo(self, request, context):
        e, cfg, snap = self.engine.config, self.engine.model_config, self.engine.snapshot()
        import jax

        from loraserve.adapters.peft import LORA_MODULES, VOCAB_MODULES

        return worker_admin_pb2.WorkerInfo(
            model_id=self.model_id,
            dtype=e.dtype,
            max_loras=e.max_loras,
            max_lora_rank=e.max_lora_rank,
            target_modules=list(LORA_MODULES + VOCAB_MODULES),
            max_batch_size=e.max_batch_size,
            max_seq_len=e.max_seq_len,
            max_cpu_loras=e.max_cpu_loras,
            vocab_size=cfg.vocab_size,
            worker_id=self.worker_id,
            platform=jax.default_backend(),
            tensor_parallel_size=e.tensor_parallel_size,
            kv_page_size=snap.kv_page_size,
            kv_pages=snap.kv_pages_total,
            max_context=e.max_seq_len,
            prefix_caching=e.enable_prefix_caching,
            max_mix=e.max_mix,
            **_device_memory(jax.local_devices()[0]),
        )


def _device_memory(device: Any) -> dict[str, int]:
    """WorkerInfo's device memory fields from ``device.memory_stats()`` (None on CPUs: zeros), and the bytes
    of the live arrays' shards on ``device`` where the runtime reports memory at all."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a runtime without the call reports no memory, as a CPU does
        stats = {}
    return {
        "device_bytes_in_use": int(stats.get("bytes_in_use", 0)),
        "device_peak_bytes_in_use": int(stats.get("peak_bytes_in_use", 0)),
        "device_bytes_limit": int(stats.get("bytes_limit", 0)),
        "device_array_bytes": _array_bytes(device) if stats else 0,
    }


def _array_bytes(device: Any) -> int:
    """On-device bytes of every live JAX array's shards on ``device`` (tiles and padding included)."""
    import jax

    total = 0
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            if shard.device == device:
                total += shard.data.on_device_size_in_bytes()
    return total


SERVICE_NAMES = (
    inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
    worker_admin_pb2.DESCRIPTOR.services_by_name["WorkerAdmin"].full_name,
)


def worker_services(engine: Engine, tokenizer: Any, model_id: str) -> Services:
    inference = InferenceServicer(engine, tokenizer)

    def add(server: grpc.aio.Server) -> None:  # bytes that are no request: INVALID_ARGUMENT (common.limits)
        add_servicer(inference_pb2_grpc.add_InferenceServicer_to_server, inference, server)
        admin = WorkerAdminServicer(engine, model_id)
        add_servicer(worker_admin_pb2_grpc.add_WorkerAdminServicer_to_server, admin, server)

    return Services("worker", add, SERVICE_NAMES, MAX_MESSAGE_BYTES, inference)


def build_server(
    engine: Engine, tokenizer: Any, model_id: str, address: str, security: ServerSecurity | None = None
) -> tuple[grpc.aio.Server, int, Any]:
    """A grpc.aio server with every worker service; returns (server, bound port, health servicer)."""
    return common_build_server(worker_services(engine, tokenizer, model_id), address, security)


async def set_serving(health_servicer: Any, serving: bool) -> None:
    await set_health(health_servicer, SERVICE_NAMES, serving)
