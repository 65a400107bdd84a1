"""The generated modules carry the wire contract of docs/design.md §2: services, streaming kinds, field numbers."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor

from loraserve.protos.v1 import inference_pb2, placement_pb2, registry_pb2, worker_admin_pb2

UNARY, SERVER_STREAM, CLIENT_STREAM = "unary", "server_stream", "client_stream"

SERVICES = {
    (inference_pb2, "Inference"): {"Generate": SERVER_STREAM},
    (worker_admin_pb2, "WorkerAdmin"): {
        "LoadAdapter": UNARY,
        "UnloadAdapter": UNARY,
        "ListSlots": UNARY,
        "GetWorkerInfo": UNARY,
    },
    (registry_pb2, "AdapterRegistry"): {
        "UploadAdapter": CLIENT_STREAM,
        "ImportAdapter": UNARY,
        "GetAdapter": UNARY,
        "ListAdapters": UNARY,
        "DeleteAdapter": UNARY,
        "DownloadAdapter": SERVER_STREAM,
        "SetAlias": UNARY,
        "DeleteAlias": UNARY,
        "ListAliasHistory": UNARY,
        "SetBaseModelAliases": UNARY,
        "GetBaseModel": UNARY,
        "SetRunningLimit": UNARY,
        "ListRunningLimits": UNARY,
    },
    (placement_pb2, "Placement"): {
        "RegisterWorker": UNARY,
        "Heartbeat": UNARY,
        "ListWorkers": UNARY,
        "LocateAdapter": UNARY,
        "GetAdapterStats": UNARY,
    },
}

# message -> {field: (number, type name or None for scalars checked by number only)}
FIELDS = {
    inference_pb2.GenerateRequest: {
        "request_id": 1,
        "adapter": 2,
        "text": 3,
        "tokens": 4,
        "sampling": 5,
        "chat": 6,
    },
    inference_pb2.ChatMessages: {"messages": 1},
    inference_pb2.ChatMessage: {"role": 1, "content": 2},
    inference_pb2.TokenIds: {"ids": 1},
    inference_pb2.SamplingParams: {
        "max_tokens": 1,
        "temperature": 2,
        "top_p": 3,
        "top_k": 4,
        "seed": 5,
        "stop": 6,
        "stop_token_ids": 7,
        "ignore_eos": 8,
        "logprobs": 9,
    },
    inference_pb2.GenerateResponse: {
        "request_id": 1,
        "token_ids": 2,
        "text": 3,
        "finish_reason": 4,
        "usage": 5,
        "adapter": 6,
        "logprobs": 7,
    },
    inference_pb2.TokenLogprobs: {"chosen": 1, "top": 2},
    inference_pb2.Logprob: {"token_id": 1, "logprob": 2, "token": 3, "token_bytes": 4},
    inference_pb2.Usage: {"prompt_tokens": 1, "completion_tokens": 2},
    registry_pb2.AliasTarget: {"version": 1, "weight": 2},
    registry_pb2.Alias: {"name": 1, "alias": 2, "targets": 3, "updated_at": 4, "updated_by": 5},
    registry_pb2.AliasChange: {"name": 1, "alias": 2, "before": 3, "after": 4, "actor": 5, "at": 6},
    placement_pb2.LocateAdapterResponse: {"candidates": 1, "adapter": 2, "split": 3},
    registry_pb2.Adapter: {
        "name": 1,
        "version": 2,
        "base_model": 3,
        "rank": 4,
        "alpha": 5,
        "use_rslora": 6,
        "target_modules": 7,
        "size_bytes": 8,
        "sha256": 9,
        "uri": 10,
        "created_at": 11,
        "description": 12,
        "labels": 13,
    },
    # tensor parallelism (docs/design.md §10.2): new numbers, nothing renumbered
    placement_pb2.RegisterWorkerRequest: {"max_batch_size": 6, "tensor_parallel_size": 7},
    placement_pb2.Worker: {"lease_expires_at": 9, "tensor_parallel_size": 10},
    worker_admin_pb2.WorkerInfo: {"platform": 11, "tensor_parallel_size": 12},
}


def _kind(method: descriptor.MethodDescriptor) -> str:
    if method.client_streaming and method.server_streaming:
        return "bidi"
    if method.client_streaming:
        return CLIENT_STREAM
    if method.server_streaming:
        return SERVER_STREAM
    return UNARY


@pytest.mark.parametrize(("module", "service"), list(SERVICES), ids=lambda v: getattr(v, "__name__", v))
def test_service_methods_and_streaming_kinds(module, service) -> None:
    svc = module.DESCRIPTOR.services_by_name[service]
    assert svc.full_name == f"loraserve.v1.{service}"
    assert {m.name: _kind(m) for m in svc.methods} == SERVICES[(module, service)]


@pytest.mark.parametrize("message", list(FIELDS), ids=lambda m: m.DESCRIPTOR.name)
def test_field_numbers(message) -> None:
    numbers = {f.name: f.number for f in message.DESCRIPTOR.fields}
    for name, number in FIELDS[message].items():
        assert numbers.get(name) == number, f"{message.DESCRIPTOR.name}.{name}"


def test_prompt_is_a_oneof_and_seed_has_presence() -> None:
    req = inference_pb2.GenerateRequest.DESCRIPTOR
    assert [f.name for f in req.oneofs_by_name["prompt"].fields] == ["text", "tokens", "chat"]
    params = inference_pb2.SamplingParams()
    assert not params.HasField("seed")
    params.seed = 0
    assert params.HasField("seed")  # seed 0 is a real seed, distinct from "unset"
    assert not params.HasField("logprobs")
    params.logprobs = 0
    assert params.HasField("logprobs")  # logprobs 0: the chosen token's only, distinct from "none"


def test_finish_reasons() -> None:
    values = {v.name: v.number for v in inference_pb2.FinishReason.DESCRIPTOR.values}
    assert values == {
        "FINISH_REASON_UNSPECIFIED": 0,
        "FINISH_REASON_LENGTH": 1,
        "FINISH_REASON_STOP": 2,
        "FINISH_REASON_EOS": 3,
    }


def test_every_field_is_documented() -> None:
    """Every message field in the .proto sources carries a comment line right above it."""
    import re
    from pathlib import Path

    import loraserve.protos.build as build

    field_re = re.compile(r"^\s*(optional |repeated )?[\w.<>, ]+ \w+ = \d+;")
    for path in build.proto_sources():
        lines = Path(path).read_text().splitlines()
        for i, line in enumerate(lines):
            if field_re.match(line) and not line.strip().startswith(("rpc", "//")):
                assert lines[i - 1].strip().startswith("//"), (
                    f"{path.name}:{i + 1} undocumented: {line.strip()}"
                )


def test_generated_modules_round_trip() -> None:
    req = inference_pb2.GenerateRequest(
        adapter="sql-helper@3",
        tokens=inference_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=inference_pb2.SamplingParams(max_tokens=8, temperature=0.5, seed=7, stop=["\n"]),
    )
    back = inference_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("prompt") == "tokens"
    assert list(back.tokens.ids) == [1, 2, 3]
    assert back.sampling.seed == 7 and back.sampling.stop == ["\n"]
