"""The OpenAI-compatible HTTP API of a real worker (tiny Llama + PEFT adapters), driven by the official
``openai`` SDK (sync and async, streaming and not, completions and chat) and checked token for token
against the worker's gRPC ``Generate`` for the same request."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket
import time

import grpc
import httpx
import openai
import pytest
from prometheus_client import REGISTRY

from loraserve.client.sdk import Client
from loraserve.common.security import ServerSecurity
from loraserve.httpapi.app import build_app
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.worker.http_backend import WorkerHttpBackend
from loraserve.worker.server import InferenceServicer
from tests.aio_thread import http_server_thread
from tests.httpapi.conftest import MODEL, Served

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def _grpc_text(served: Served, adapter: str = "", **sampling) -> tuple[str, list[int], pb.GenerateResponse]:
    req = pb.GenerateRequest(adapter=adapter, text=PROMPT, sampling=pb.SamplingParams(**sampling))
    msgs = served.grpc(req)
    return "".join(m.text for m in msgs), [t for m in msgs for t in m.token_ids], msgs[-1]


def _grpc_chat(served: Served, adapter: str = "", **sampling) -> tuple[str, pb.GenerateResponse]:
    req = pb.GenerateRequest(adapter=adapter, sampling=pb.SamplingParams(**sampling))
    req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES)
    msgs = served.grpc(req)
    return "".join(m.text for m in msgs), msgs[-1]


@pytest.mark.parametrize("model,adapter", [(MODEL, ""), ("all-r4", "all-r4")])
def test_completion_equals_grpc(served, model, adapter) -> None:
    want, ids, last = _grpc_text(served, adapter, max_tokens=12, ignore_eos=True)
    out = served.client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion" and out.model == model
    assert out.choices[0].text == want and len(ids) == 12
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == last.usage.prompt_tokens
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == last.usage.prompt_tokens + 12


def test_completion_from_token_ids_equals_grpc(served) -> None:
    ids = served.worker.tokenizer(PROMPT)["input_ids"]
    want, _, _ = _grpc_text(served, "mlp-r16", max_tokens=6, ignore_eos=True)
    out = served.client.completions.create(
        model="mlp-r16", prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == want


OTHER = "A list of colours:"


def _grpc_completion(served: Served, prompt: str, **sampling) -> tuple[str, pb.GenerateResponse, float]:
    """gRPC's text, last message and summed generated-token logprob for one prompt on all-r4."""
    req = pb.GenerateRequest(
        adapter="all-r4", text=prompt, sampling=pb.SamplingParams(logprobs=0, **sampling)
    )
    msgs = served.grpc(req)
    return "".join(m.text for m in msgs), msgs[-1], sum(e.chosen.logprob for m in msgs for e in m.logprobs)


def test_several_prompts_and_n_choices_each_equal_grpc_with_usage_summed(served) -> None:
    out = served.client.completions.create(
        model="all-r4",
        prompt=[PROMPT, OTHER],
        n=2,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    want = [_grpc_completion(served, p, max_tokens=5, ignore_eos=True) for p in (PROMPT, OTHER)]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [want[0][0], want[0][0], want[1][0], want[1][0]]  # greedy: alike
    assert out.usage.prompt_tokens == want[0][1].usage.prompt_tokens + want[1][1].usage.prompt_tokens
    assert out.usage.completion_tokens == 4 * 5

    seeded = served.client.completions.create(
        model="all-r4",
        prompt=PROMPT,
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    texts = [
        _grpc_completion(served, PROMPT, max_tokens=6, temperature=1.0, seed=7 + k, ignore_eos=True)[0]
        for k in range(3)
    ]
    assert [c.text for c in seeded.choices] == texts  # choice k is seed + k: distinct and reproducible
    assert len(set(texts)) > 1

    streamed = served.client.completions.create(
        model="all-r4",
        prompt=[PROMPT, OTHER],
        n=2,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    joined = ["", "", "", ""]
    chunks = list(streamed)
    for c in chunks:
        for choice in c.choices:
            joined[choice.index] += choice.text
    assert joined == [c.text for c in out.choices]
    assert (
        chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens
    )
    assert all(c.usage is None for c in chunks[:-1])  # include_usage alone: the usage chunk only

    # vLLM's continuous_usage_stats (guidellm and vLLM's clients send it): every chunk carries the usage so
    # far, the prompts counted once each, the completion tokens of every choice up to that chunk
    streamed = served.client.completions.create(
        model="all-r4", prompt=[PROMPT, OTHER], n=2, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(streamed)
    generated = [c.usage.completion_tokens for c in chunks[:-1]]
    assert all(c.usage.prompt_tokens == out.usage.prompt_tokens for c in chunks)
    assert generated == sorted(generated) and generated[0] >= 1 and generated[-1] == 20
    assert (
        len(chunks) == 21 and chunks[-1].usage.completion_tokens == 20
    )  # 4 x 5 tokens, then the usage chunk


def test_best_of_returns_the_candidates_with_the_highest_summed_logprob(served) -> None:
    out = served.client.completions.create(
        model="all-r4",
        prompt=PROMPT,
        n=1,
        best_of=3,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    candidates = [
        _grpc_completion(served, PROMPT, max_tokens=6, temperature=1.0, seed=11 + k, ignore_eos=True)
        for k in range(3)
    ]
    best = max(candidates, key=lambda c: c[2])
    assert len(out.choices) == 1 and out.choices[0].text == best[0]
    assert out.choices[0].logprobs is None  # ranked by logprobs the caller did not ask to see
    assert out.usage.completion_tokens == 3 * 6  # every candidate was generated
    two = served.client.chat.completions.create(
        model="all-r4", messages=MESSAGES, n=2, max_tokens=4, temperature=1.0, seed=3
    )
    want = [_grpc_chat(served, "all-r4", max_tokens=4, temperature=1.0, seed=3 + k)[0] for k in range(2)]
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == want


def test_streamed_completion_with_usage(served) -> None:
    want, _, last = _grpc_text(served, "all-r4", max_tokens=10, ignore_eos=True)
    stream = served.client.completions.create(
        model="all-r4",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == last.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_equals_grpc_and_uses_the_template(served) -> None:
    want, last = _grpc_chat(served, "all-r4", max_tokens=8, ignore_eos=True)
    out = served.client.chat.completions.create(
        model="all-r4",
        messages=MESSAGES,
        max_completion_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    templated = served.worker.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True
    )
    if not isinstance(templated, list):
        templated = templated["input_ids"]
    assert out.usage.prompt_tokens == len(templated) == last.usage.prompt_tokens


def test_streamed_chat_async(served) -> None:
    want, _ = _grpc_chat(served, "mlp-r16", max_tokens=8, ignore_eos=True)

    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model="mlp-r16",
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        await client.close()
        return chunks

    chunks = asyncio.run(main())
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_completion_and_seeded_sampling(served) -> None:
    want, _, _ = _grpc_text(served, "", max_tokens=10, temperature=0.9, seed=1234, ignore_eos=True)

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        outs = await asyncio.gather(
            *[
                client.completions.create(
                    model=MODEL,
                    prompt=PROMPT,
                    max_tokens=10,
                    temperature=0.9,
                    seed=1234,
                    extra_body={"ignore_eos": True},
                )
                for _ in range(3)
            ]
        )
        await client.close()
        return [o.choices[0].text for o in outs]

    assert asyncio.run(main()) == [want] * 3


def test_stop_string_and_stop_token(served) -> None:
    full, ids, _ = _grpc_text(served, "all-r4", max_tokens=12, ignore_eos=True)
    stop = full[3:6]
    out = served.client.completions.create(
        model="all-r4",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"
    out = served.client.completions.create(
        model="all-r4",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [ids[4]], "ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == ids.index(ids[4]) + 1


def test_logits_controls_equal_grpc_and_change_the_tokens(served) -> None:
    controls = dict(presence_penalty=1.2, frequency_penalty=0.7, min_tokens=4, logit_bias={5: 40.0})
    want, ids, _ = _grpc_text(served, "all-r4", max_tokens=10, repetition_penalty=1.3, **controls)
    _, plain_ids, _ = _grpc_text(served, "all-r4", max_tokens=10)
    out = served.client.completions.create(
        model="all-r4",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        presence_penalty=1.2,
        frequency_penalty=0.7,
        logit_bias={"5": 40.0},
        extra_body={"repetition_penalty": 1.3, "min_tokens": 4},
    )
    assert out.choices[0].text == want and out.usage.completion_tokens == len(ids)
    assert ids != plain_ids and 5 in ids  # the controls moved the tokens
    chat = served.client.chat.completions.create(
        model="all-r4", messages=MESSAGES, max_tokens=6, temperature=0, logit_bias={"5": 100.0}
    )
    assert chat.choices[0].message.content == served.worker.tokenizer.decode([5] * 6)  # nothing but token 5


def test_structured_outputs_through_the_openai_sdk(served) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"enum": ["Ada", "Alan"]},
            "age": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    chat = served.client.chat.completions.create(
        model="all-r4",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    person = json.loads(chat.choices[0].message.content)
    assert person["name"] in ("Ada", "Alan") and 1 <= person["age"] <= 99 and set(person) == {"name", "age"}
    assert chat.choices[0].finish_reason == "stop"
    obj = served.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    for extra, pattern in [
        ({"guided_choice": ["alpha", "beta"]}, r"alpha|beta"),
        ({"guided_regex": r"[0-9]{3}"}, r"[0-9]{3}"),
        ({"guided_grammar": 'root ::= "x" [a-c]'}, r"x[a-c]"),
        ({"structured_outputs": {"regex": r"[A-Z]{2}"}}, r"[A-Z]{2}"),
        ({"guided_json": schema}, None),
    ]:
        out = served.client.completions.create(
            model="mlp-r16", prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra
        )
        text = out.choices[0].text
        if pattern is None:
            assert set(json.loads(text)) == {"name", "age"}
        else:
            assert re.fullmatch(pattern, text), (extra, text)
        assert out.choices[0].finish_reason == "stop", extra


def test_logprobs_equal_grpc(served) -> None:
    req = pb.GenerateRequest(
        adapter="all-r4", text=PROMPT, sampling=pb.SamplingParams(max_tokens=5, logprobs=3)
    )
    want = [e for m in served.grpc(req) for e in m.logprobs]
    assert len(want) == 5
    out = served.client.completions.create(
        model="all-r4", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.chosen.logprob for e in want], abs=1e-6)
    assert lp.tokens == [e.chosen.token for e in want]
    assert [list(d.values()) for d in lp.top_logprobs] == [
        pytest.approx([t.logprob for t in e.top], abs=1e-6) for e in want
    ]
    chat = served.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob <= 0 and item.bytes is not None


def test_top_logprobs_are_as_many_as_asked_and_offsets_count_characters(served) -> None:
    """logprobs=5 gives 5 alternatives per token in the legacy API's dict although most of this tiny model's
    tokens are single bytes (pieces of characters decode to one U+FFFD, which collided as dict keys): such a
    token is spelled ``bytes:\\xNN``; text_offset counts the characters before each token, a character split
    over tokens counted once."""
    text = "Ünïcödé café 東京 🙂"
    out = served.client.completions.create(
        model="all-r4", prompt=text, max_tokens=24, temperature=0, logprobs=5, echo=True
    )
    lp = out.choices[0].logprobs
    assert all(len(top) == 5 for top in lp.top_logprobs[1:]), [len(t or {}) for t in lp.top_logprobs]
    assert any(k.startswith("bytes:\\x") for top in lp.top_logprobs[1:] for k in top)
    offsets = lp.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(out.choices[0].text)
    prompt_tokens = out.usage.prompt_tokens
    assert offsets[prompt_tokens] == len(text)  # the first generated token starts where the prompt ends


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_asks(served) -> None:
    """lm-eval's log-likelihood request (echo, logprobs=1, max_tokens=1) and vLLM's (max_tokens=0): the
    prompt's tokens with their logprobs (the first null), then the generated token's; equal to gRPC's."""
    req = pb.GenerateRequest(
        adapter="all-r4", text=PROMPT, sampling=pb.SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1)
    )
    msgs = served.grpc(req)
    prompt_lp, generated = list(msgs[0].prompt_logprobs), [e for m in msgs for e in m.logprobs]
    n = msgs[-1].usage.prompt_tokens
    assert len(prompt_lp) == len(msgs[0].prompt_token_ids) == n and math.isnan(prompt_lp[0].chosen.logprob)
    out = served.client.completions.create(
        model="all-r4", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choice = out.choices[0]
    assert choice.text == PROMPT + "".join(m.text for m in msgs)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e.chosen.logprob for e in prompt_lp[1:] + generated]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-6)
    assert lp.tokens == [e.chosen.token for e in prompt_lp + generated]
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(
        PROMPT
    )  # the generated token after the prompt
    assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 1

    alone = served.client.completions.create(
        model="all-r4", prompt=PROMPT, max_tokens=0, logprobs=1, echo=True
    )
    assert alone.choices[0].text == PROMPT and alone.choices[0].finish_reason == "length"
    assert alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want[:-1], abs=1e-6)

    ids = served.worker.tokenizer(PROMPT)["input_ids"]  # token ids echo as their tokens' text
    by_ids = served.client.completions.create(model="all-r4", prompt=ids, max_tokens=0, echo=True)
    assert by_ids.choices[0].text == "".join(e.chosen.token for e in prompt_lp)

    stream = served.client.completions.create(
        model="all-r4", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True, stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert chunks[0].choices[0].logprobs.token_logprobs[1:n] == pytest.approx(want[: n - 1], abs=1e-6)
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == n + 3

    with Client(served.worker.address) as sdk:  # the SDK's form of the same question
        scored = sdk.complete(PROMPT, adapter="all-r4", prompt_logprobs=1, prompt_only=True)
    assert scored.token_ids == [] and scored.prompt_token_ids == list(msgs[0].prompt_token_ids)
    assert scored.prompt_logprobs[0].chosen.logprob is None
    assert [e.chosen.logprob for e in scored.prompt_logprobs[1:]] == pytest.approx(want[:-1], abs=1e-6)

    refused = httpx.post(
        f"{served.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0}
    )
    assert refused.status_code == 400 and "needs echo=true" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "max_tokens"


def test_models_lists_the_base_and_the_adapters(served) -> None:
    ids = [m.id for m in served.client.models.list()]
    assert ids[0] == MODEL and {"all-r4", "mlp-r16"} <= set(ids)
    card = httpx.get(f"{served.url}/v1/models/all-r4").json()
    assert card["parent"] == MODEL and card["owned_by"] and card["object"] == "model"


def test_health_and_metrics(served) -> None:
    assert httpx.get(f"{served.url}/health").status_code == 200
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    text = httpx.get(f"{served.url}/metrics").text
    assert 'loraserve_http_requests_total{route="/v1/completions",server="worker",status="200"}' in text


def _generated() -> float:
    return REGISTRY.get_sample_value("loraserve_generation_tokens_total", {"server": "worker"}) or 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_request(served, stream, caplog) -> None:
    """The client goes away mid-generation (a stream after its first chunk): the request is cancelled within a
    few engine steps of its leaving (a non-streamed request's server used to poll for a disconnect every 0.25 s:
    74-92 more tokens; now 1-3 either way), its row and slot reference are freed, and nothing is logged above
    INFO (a client leaving is no server error)."""
    engine = served.worker.engine
    body = json.dumps(
        {"model": "all-r4", "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": stream}
    )
    before = _generated()
    cancelled = dict(engine.snapshot().cancelled)["client"]
    with caplog.at_level(logging.INFO), socket.create_connection(("127.0.0.1", served.port)) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body.encode())
        deadline = time.monotonic() + 30
        while engine.snapshot().running == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
        if stream:  # read until the first chunk's data line, then leave
            sock.settimeout(30)
            got = b""
            while b"data: " not in got:
                got += sock.recv(4096)
        left_at = engine.snapshot().tokens_out
        sock.shutdown(socket.SHUT_RDWR)
    _wait_idle(engine)
    snap = engine.snapshot()
    # the engine's steps while the cancel travels (batch 1: ~2 ms each)
    assert snap.tokens_out - left_at <= 16
    assert _generated() - before < 480 and dict(snap.cancelled)["client"] == cancelled + 1
    time.sleep(0.2)  # the server's handling of the closed connection ends on its own thread
    loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno > logging.INFO]
    assert loud == []


def _wait_idle(engine) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        snap = engine.snapshot()
        if snap.running == 0 and snap.waiting == 0 and all(s.refcount == 0 for s in snap.slots):
            return
        time.sleep(0.05)
    snap = engine.snapshot()
    raise AssertionError(f"still busy: running={snap.running} waiting={snap.waiting}")


def test_deadline_is_504(served) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "ignore_eos": True}
    resp = httpx.post(
        f"{served.url}/v1/completions", json=body, headers={"x-loraserve-timeout": "0.05"}, timeout=30
    )
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "DEADLINE_EXCEEDED"
    _wait_idle(served.worker.engine)


def test_bearer_tokens(served) -> None:
    security = ServerSecurity(inference_tokens=("inf-1",), admin_tokens=("adm-1",))
    w = served.worker

    def app():
        return build_app(WorkerHttpBackend(InferenceServicer(w.engine, w.tokenizer), MODEL), security)

    with http_server_thread(app) as port:
        url = f"http://127.0.0.1:{port}"
        for token in ("inf-1", "adm-1"):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0)
            # OpenAI's default temperature is 1: without ignore_eos a sampled EOS may end the answer early.
            out = client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True}
            )
            assert out.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        assert err.value.status_code == 401 and "bad token" in err.value.body["message"]
        missing = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "UNAUTHENTICATED"
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no token


def test_chat_without_a_template_is_400(served) -> None:
    import copy

    w = served.worker
    plain = copy.deepcopy(w.tokenizer)
    plain.chat_template = None

    def app():
        return build_app(WorkerHttpBackend(InferenceServicer(w.engine, plain), MODEL))

    with http_server_thread(app) as port:
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}
        )
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "FAILED_PRECONDITION" and "no chat template" in err["message"]


def test_grpc_chat_with_an_unknown_role_is_invalid(served) -> None:
    req = pb.GenerateRequest()
    req.chat.messages.add(role="wizard", content="hi")
    with pytest.raises(grpc.RpcError) as err:
        served.grpc(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "wizard" in err.value.details()
