"""The worker over real gRPC on loopback: streaming, finish reasons, usage, stop, cancel, errors, admin, health."""

from __future__ import annotations

import math
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve.engine.config import EngineConfig
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.protos.v1 import inference_pb2_grpc, worker_admin_pb2, worker_admin_pb2_grpc
from loraserve.worker.token_strings import spelled
from tests.worker.serving import running_worker

PROMPT = [5, 17, 33, 100, 7]


@pytest.fixture(scope="module")
def worker(llama_dir, adapter_dirs):
    cfg = EngineConfig(max_batch_size=4, max_seq_len=64, max_loras=2, max_lora_rank=16)
    with running_worker(
        llama_dir, cfg, {"all-r4": adapter_dirs["all-r4"], "mlp-r16": adapter_dirs["mlp-r16"]}, warmup=False
    ) as w:
        yield w


def _stub(worker):
    return inference_pb2_grpc.InferenceStub(worker.channel)


def _admin(worker):
    return worker_admin_pb2_grpc.WorkerAdminStub(worker.channel)


def _generate(worker, **kw):
    sampling = kw.pop("sampling", pb.SamplingParams(max_tokens=8))
    req = pb.GenerateRequest(sampling=sampling, **kw)
    if "text" not in kw and "tokens" not in kw:
        req.tokens.ids.extend(PROMPT)
    return list(_stub(worker).Generate(req, timeout=60))


def _hf_greedy(llama_dir, adapter_dir, prompt, n):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir)).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return out[0, len(prompt) :].tolist()


def test_stream_matches_hf_greedy_with_usage(worker, llama_dir, adapter_dirs) -> None:
    for adapter, adir in (("", None), ("all-r4", adapter_dirs["all-r4"])):
        responses = _generate(
            worker,
            adapter=adapter,
            request_id="req-1",
            sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True),
        )
        tokens = [t for r in responses for t in r.token_ids]
        assert tokens == _hf_greedy(llama_dir, adir, PROMPT, 8)
        assert len(responses) == 8  # one message per decoded token; the 8th carries the finish
        assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
        last = responses[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 8)
        assert {r.request_id for r in responses} == {"req-1"}
        assert {r.adapter for r in responses} == {adapter}


def test_text_prompt_and_utf8_safe_deltas(worker) -> None:
    responses = _generate(
        worker, text="Ünïcödé café 東京", sampling=pb.SamplingParams(max_tokens=24, ignore_eos=True)
    )
    tokens = [t for r in responses for t in r.token_ids]
    text = "".join(r.text for r in responses)
    assert text == worker.tokenizer.decode(
        tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    prompt_ids = worker.tokenizer("Ünïcödé café 東京")["input_ids"]
    assert responses[-1].usage.prompt_tokens == len(prompt_ids)


def test_stop_string_and_stop_token(worker) -> None:
    free = _generate(worker, sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True))
    text = "".join(r.text for r in free)
    tokens = [t for r in free for t in r.token_ids]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    stopped = _generate(worker, sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop]))
    assert "".join(r.text for r in stopped) == text[: text.index(stop)]
    assert stopped[-1].finish_reason == pb.FINISH_REASON_STOP
    by_id = _generate(
        worker, sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[tokens[3]])
    )
    got = [t for r in by_id for t in r.token_ids]
    assert got == tokens[: tokens.index(tokens[3]) + 1]
    assert by_id[-1].finish_reason == pb.FINISH_REASON_STOP
    assert by_id[-1].usage.completion_tokens == len(got)


def test_logprobs_one_entry_per_token_with_strings_and_bytes(worker) -> None:
    """Text prompt, greedy: every response carries one TokenLogprobs per token id (chosen = that id, top
    = the 4 most likely, descending, greedy chosen = top[0]); token strings are the tokenizer's, and the
    byte-level tokenizer's token_bytes of the chosen tokens decode (lossily, as the tokenizer does: the tiny
    random model strings bytes into invalid UTF-8) to the text."""
    tok = worker.tokenizer
    sampling = pb.SamplingParams(max_tokens=24, ignore_eos=True, logprobs=4)
    responses = _generate(worker, text="Ünïcödé café 東京", sampling=sampling)
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    chosen = [lp.chosen for r in responses for lp in r.logprobs]
    tokens = [t for r in responses for t in r.token_ids]
    assert [c.token_id for c in chosen] == tokens and len(tokens) == 24
    for lp in (lp for r in responses for lp in r.logprobs):
        assert len(lp.top) == 4 and lp.top[0].token_id == lp.chosen.token_id
        assert lp.top[0].logprob == lp.chosen.logprob < 0
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        for t in (lp.chosen, *lp.top):
            want = tok.decode([t.token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            assert t.token == spelled(want, t.token_bytes)  # a piece of a character: its bytes spelled
        assert len({t.token for t in lp.top}) == len(lp.top)  # 4 distinct spellings for 4 distinct ids
    special = set(tok.all_special_ids)
    text = "".join(r.text for r in responses)
    raw = b"".join(c.token_bytes for c in chosen if c.token_id not in special)
    assert raw.decode("utf-8", errors="replace") == text
    # some token is a lone byte of a multi-byte character: true bytes, spelled "bytes:\\xNN" as its string
    assert any(c.token.startswith("bytes:\\x") for c in chosen)
    plain = _generate(
        worker, text="Ünïcödé café 東京", sampling=pb.SamplingParams(max_tokens=24, ignore_eos=True)
    )
    assert [t for r in plain for t in r.token_ids] == tokens
    assert all(not r.logprobs for r in plain)  # unset: no logprobs


def test_logprobs_travel_with_their_tokens_under_a_stop_string(worker) -> None:
    free = _generate(worker, sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True, logprobs=0))
    text = "".join(r.text for r in free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    sampling = pb.SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop], logprobs=0)
    stopped = _generate(worker, sampling=sampling)
    assert stopped[-1].finish_reason == pb.FINISH_REASON_STOP
    assert all(len(r.logprobs) == len(r.token_ids) for r in stopped)
    ids = [t for r in stopped for t in r.token_ids]
    lps = [lp for r in stopped for lp in r.logprobs]
    want = [lp for r in free for lp in r.logprobs][: len(ids)]
    assert [lp.chosen.token_id for lp in lps] == ids
    assert [(lp.chosen.token_id, lp.chosen.logprob) for lp in lps] == [
        (lp.chosen.token_id, lp.chosen.logprob) for lp in want
    ]
    assert all(not lp.top for lp in lps)  # logprobs=0: the token's own only


def _wait_refcounts_zero(worker, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        slots = _admin(worker).ListSlots(worker_admin_pb2.ListSlotsRequest()).slots
        if all(s.refcount == 0 for s in slots) and worker.engine.snapshot().running == 0:
            return slots
        time.sleep(0.02)
    raise AssertionError(f"refcounts not released: {slots}")


def test_cancel_mid_stream_frees_row_and_slot(worker) -> None:
    req = pb.GenerateRequest(
        adapter="mlp-r16",
        tokens=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(max_tokens=58, ignore_eos=True),
    )
    call = _stub(worker).Generate(req, timeout=60)
    first = next(call)
    assert first.token_ids and first.adapter == "mlp-r16"
    slots = _admin(worker).ListSlots(worker_admin_pb2.ListSlotsRequest()).slots
    assert [s.refcount for s in slots if s.adapter == "mlp-r16"] == [1]
    call.cancel()
    slots = _wait_refcounts_zero(worker)
    assert any(s.adapter == "mlp-r16" for s in slots)


def test_deadline_exceeded_frees_row(worker) -> None:
    req = pb.GenerateRequest(
        adapter="all-r4",
        tokens=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(max_tokens=58, ignore_eos=True),
    )
    with pytest.raises(grpc.RpcError) as exc:
        for _ in _stub(worker).Generate(req, timeout=0.3):
            time.sleep(0.05)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_refcounts_zero(worker)


@pytest.mark.parametrize(
    ("kwargs", "code", "needle"),
    [
        (dict(tokens=pb.TokenIds(ids=[])), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (dict(text=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (dict(tokens=pb.TokenIds(ids=[5] * 64)), grpc.StatusCode.INVALID_ARGUMENT, "context"),
        (dict(tokens=pb.TokenIds(ids=[5, 99999])), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (dict(sampling=pb.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (
            dict(sampling=pb.SamplingParams(temperature=math.nan)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature",
        ),
        (dict(sampling=pb.SamplingParams(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (
            dict(sampling=pb.SamplingParams(stop_token_ids=[-3])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "stop_token_ids",
        ),
        (
            dict(sampling=pb.SamplingParams(logprobs=21)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "logprobs must be in [0, 20]",
        ),
        (dict(adapter="Bad/Name"), grpc.StatusCode.INVALID_ARGUMENT, "adapter name"),
        (dict(adapter="x@0"), grpc.StatusCode.INVALID_ARGUMENT, "version"),
        (dict(adapter="no-such-adapter"), grpc.StatusCode.NOT_FOUND, "no-such-adapter"),
    ],
)
def test_invalid_requests_get_documented_codes(worker, kwargs, code, needle) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        _generate(worker, **kwargs)
    assert exc.value.code() == code
    assert needle in exc.value.details()
    # the worker is unharmed: a normal request still works
    assert _generate(worker, sampling=pb.SamplingParams(max_tokens=2))[-1].usage.completion_tokens == 2


def test_admin_load_list_info_unload(worker, adapter_dirs) -> None:
    admin = _admin(worker)
    info = admin.GetWorkerInfo(worker_admin_pb2.GetWorkerInfoRequest())
    assert (info.max_loras, info.max_lora_rank, info.max_batch_size, info.max_seq_len) == (2, 16, 4, 64)
    assert info.platform == "cpu" and info.dtype == "float32" and "down_proj" in info.target_modules
    assert info.tensor_parallel_size == 1 and info.max_mix == 4
    # the default pool: max_batch_size full contexts of 16-token pages (4 rows x 4 pages)
    assert (info.kv_page_size, info.kv_pages, info.max_context, info.prefix_caching) == (16, 16, 64, True)
    slot = admin.LoadAdapter(
        worker_admin_pb2.LoadAdapterRequest(
            adapter="qv", source_uri=str(adapter_dirs["qv-r8-rslora"]), pin=True
        )
    )
    assert (
        slot.adapter == "qv"
        and slot.state == worker_admin_pb2.SLOT_STATE_LOADED
        and slot.pinned
        and slot.rank == 8
    )
    listed = {s.adapter: s for s in admin.ListSlots(worker_admin_pb2.ListSlotsRequest()).slots}
    assert listed["qv"].pinned and listed["qv"].refcount == 0
    resp = admin.UnloadAdapter(worker_admin_pb2.UnloadAdapterRequest(adapter="qv"))
    assert resp.adapter == "qv" and resp.slot == slot.slot
    assert "qv" not in {s.adapter for s in admin.ListSlots(worker_admin_pb2.ListSlotsRequest()).slots}
    with pytest.raises(grpc.RpcError) as exc:
        admin.UnloadAdapter(worker_admin_pb2.UnloadAdapterRequest(adapter="qv"))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as exc:
        admin.LoadAdapter(
            worker_admin_pb2.LoadAdapterRequest(adapter="missing", source_uri="/nonexistent/adapter")
        )
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_reflection(worker) -> None:
    health = health_pb2_grpc.HealthStub(worker.channel)
    for service in ("", "loraserve.v1.Inference", "loraserve.v1.WorkerAdmin"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=service)).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(worker.channel)
    resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"loraserve.v1.Inference", "loraserve.v1.WorkerAdmin", "grpc.health.v1.Health"} <= names
