"""Fuzzing every request message against live servers: no crash, no hang, only documented codes,
and a fuzzed adapter upload never reaches storage."""

from __future__ import annotations

import hashlib
import json

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraserve.engine.config import EngineConfig
from loraserve.protos.v1 import inference_pb2 as ipb
from loraserve.protos.v1 import (
    inference_pb2_grpc,
    placement_pb2_grpc,
    registry_pb2_grpc,
    worker_admin_pb2_grpc,
)
from loraserve.protos.v1 import placement_pb2 as pp
from loraserve.protos.v1 import registry_pb2 as rp
from loraserve.protos.v1 import worker_admin_pb2 as wa
from loraserve.registry.app import open_registry
from loraserve.registry.config import RegistryConfig
from loraserve.registry.server import build_server as build_registry
from loraserve.worker.server import build_server as build_worker
from loraserve.worker.tokenizer import load_tokenizer
from tests.aio_thread import aio_server_thread
from tests.engines import started_engine

DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.PERMISSION_DENIED,  # ImportAdapter outside --import-allow
}
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
text = st.text(max_size=40)
names = st.one_of(
    text, st.from_regex(r"[a-z0-9][a-z0-9._-]{0,12}(@[0-9]{1,3})?", fullmatch=True), st.just("all-r4")
)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
u32 = st.integers(0, 2**32 - 1)


def _code(fn) -> grpc.StatusCode:
    try:
        result = fn()
        if hasattr(result, "__iter__") and not isinstance(result, bytes | str):
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def servers(llama_dir, adapter_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    tokenizer = load_tokenizer(str(llama_dir))
    registry = open_registry(
        RegistryConfig(db=f"sqlite:///{tmp / 'r.db'}", storage=str(tmp / "s"), max_upload_bytes=1 << 16)
    )

    config = EngineConfig(
        max_batch_size=4, max_seq_len=32, max_loras=1, min_prefill_bucket=32
    )  # one prefill bucket: a shorter warm-up
    with started_engine(llama_dir, config, {"all-r4": adapter_dirs["all-r4"]}) as engine:

        async def worker():
            server, port, _ = build_worker(engine, tokenizer, "tiny", "127.0.0.1:0")
            return server, port

        async def reg():
            server, port, _ = build_registry(registry.catalog, registry.placement, "127.0.0.1:0")
            return server, port

        with (
            aio_server_thread(worker) as wport,
            aio_server_thread(reg) as rport,
            grpc.insecure_channel(f"127.0.0.1:{wport}") as wch,
            grpc.insecure_channel(f"127.0.0.1:{rport}") as rch,
        ):
            yield {"engine": engine, "registry": registry, "worker": wch, "reg": rch}
    registry.close()


sampling = st.builds(
    ipb.SamplingParams,
    max_tokens=st.integers(0, 40),
    temperature=floats,
    top_p=floats,
    top_k=u32,
    seed=st.integers(0, 2**64 - 1),
    stop=st.lists(text, max_size=3),
    stop_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3),
    ignore_eos=st.booleans(),
)
generate_requests = st.builds(
    lambda rid, adapter, prompt, s: ipb.GenerateRequest(
        request_id=rid, adapter=adapter, sampling=s, **prompt
    ),
    text,
    st.one_of(st.just(""), names),
    st.one_of(
        st.builds(lambda t: {"text": t}, text),
        st.builds(
            lambda ids: {"tokens": ipb.TokenIds(ids=ids)},
            st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
        ),
    ),
    sampling,
)


@FUZZ
@given(req=generate_requests)
def test_fuzzed_generate(servers, req) -> None:
    stub = inference_pb2_grpc.InferenceStub(servers["worker"])
    assert _code(lambda: stub.Generate(req, timeout=20)) in DOCUMENTED


@FUZZ
@given(name=names, uri=text, pin=st.booleans(), force=st.booleans())
def test_fuzzed_worker_admin(servers, name, uri, pin, force) -> None:
    stub = worker_admin_pb2_grpc.WorkerAdminStub(servers["worker"])
    assert (
        _code(
            lambda: stub.LoadAdapter(wa.LoadAdapterRequest(adapter=name, source_uri=uri, pin=pin), timeout=20)
        )
        in DOCUMENTED
    )
    assert (
        _code(lambda: stub.UnloadAdapter(wa.UnloadAdapterRequest(adapter=name, force=force), timeout=20))
        in DOCUMENTED
    )


@FUZZ
@given(name=names, model=text, size=st.integers(0, 10), token=text, page=u32, n=u32)
def test_fuzzed_registry_requests(servers, name, model, size, token, page, n) -> None:
    reg = registry_pb2_grpc.AdapterRegistryStub(servers["reg"])
    place = placement_pb2_grpc.PlacementStub(servers["reg"])
    calls = [
        lambda: reg.GetAdapter(rp.GetAdapterRequest(adapter=name), timeout=10),
        lambda: reg.ListAdapters(
            rp.ListAdaptersRequest(page_size=page, page_token=token, base_model=model, name_prefix=name),
            timeout=10,
        ),
        lambda: reg.DeleteAdapter(rp.DeleteAdapterRequest(adapter=name + "-never"), timeout=10),
        lambda: reg.DownloadAdapter(rp.DownloadAdapterRequest(adapter=name), timeout=10),
        lambda: reg.ImportAdapter(
            rp.ImportAdapterRequest(uri=token, name=name, base_model=model), timeout=10
        ),
        lambda: place.LocateAdapter(pp.LocateAdapterRequest(adapter=name, max_candidates=n), timeout=10),
        lambda: place.Heartbeat(pp.HeartbeatRequest(worker_id=token), timeout=10),
        lambda: place.ListWorkers(pp.ListWorkersRequest(model_id=model), timeout=10),
        lambda: place.RegisterWorker(
            pp.RegisterWorkerRequest(
                address=token,
                model_id=model,
                slots=n % 64,
                max_lora_rank=page % 512,
                module_shapes=[
                    pp.ModuleShape(module=name, in_features=page, out_features=n, num_layers=size)
                ],
            ),
            timeout=10,
        ),
        lambda: reg.GetAdapter(rp.GetAdapterRequest(adapter=""), timeout=10),
        lambda: placement_pb2_grpc.PlacementStub(servers["reg"]).Heartbeat(
            pp.HeartbeatRequest(worker_id=token, slots=[wa.SlotInfo(slot=n, adapter=name, state=size % 5)]),
            timeout=10,
        ),
    ]
    for call in calls:
        assert _code(call) in DOCUMENTED


config_docs = st.one_of(
    st.binary(max_size=200),
    st.dictionaries(
        st.sampled_from(
            [
                "peft_type",
                "r",
                "lora_alpha",
                "target_modules",
                "bias",
                "use_dora",
                "modules_to_save",
                "rank_pattern",
                "use_rslora",
            ]
        ),
        st.one_of(st.integers(-5, 300), text, st.booleans(), st.lists(text, max_size=3), st.none()),
        max_size=6,
    ).map(lambda d: json.dumps(d).encode()),
)


@FUZZ
@given(config=config_docs, weights=st.binary(min_size=1, max_size=2000), lie=st.booleans())
def test_fuzzed_upload_never_reaches_storage(servers, adapter_dirs, config, weights, lie) -> None:
    if lie:  # a real safetensors header with fuzzed bytes after it
        real = (adapter_dirs["all-r4"] / "adapter_model.safetensors").read_bytes()
        weights = real[: min(len(real), 8 + len(weights))] + weights
    store = servers["registry"].catalog.store
    before = store.list_blobs()
    header = rp.UploadHeader(
        name="fuzzed",
        base_model="tiny",
        adapter_config_json=config,
        weights_size=len(weights),
        weights_sha256=hashlib.sha256(weights).hexdigest(),
    )
    stub = registry_pb2_grpc.AdapterRegistryStub(servers["reg"])
    code = _code(
        lambda: stub.UploadAdapter(
            iter([rp.UploadAdapterRequest(header=header), rp.UploadAdapterRequest(chunk=weights)]), timeout=20
        )
    )
    assert code in {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
    assert store.list_blobs() == before


def test_servers_still_serve_after_fuzzing(servers) -> None:
    stub = inference_pb2_grpc.InferenceStub(servers["worker"])
    out = list(
        stub.Generate(
            ipb.GenerateRequest(tokens=ipb.TokenIds(ids=[5, 6]), sampling=ipb.SamplingParams(max_tokens=3)),
            timeout=20,
        )
    )
    assert out[-1].usage.completion_tokens == 3
    assert servers["engine"].snapshot().running == 0


def test_registry_refuses_unparsable_bytes_and_odd_refs(servers) -> None:
    """Every unary registry and placement RPC answers a request whose bytes do not parse (a string field of
    invalid UTF-8) with INVALID_ARGUMENT, not grpc's UNKNOWN; refs whose version is no ASCII number
    (``a@²``: '²'.isdigit() is True, int('²') a ValueError) or that end in a newline are INVALID_ARGUMENT,
    not INTERNAL."""
    from loraserve.protos.v1 import placement_pb2, registry_pb2

    channel = servers["reg"]
    tried = []
    for module in (registry_pb2, placement_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                strings = [f for f in method.input_type.fields if f.type == f.TYPE_STRING]
                if method.client_streaming or not strings:
                    continue
                tried.append(method.name)
                bad_utf8 = bytes([strings[0].number << 3 | 2, 2, 0xFF, 0xFE])  # a string field, not UTF-8
                call = (channel.unary_stream if method.server_streaming else channel.unary_unary)(
                    f"/{service.full_name}/{method.name}",
                    request_serializer=lambda b: b,
                    response_deserializer=lambda b: b,
                )
                code = _code(lambda call=call, raw=bad_utf8: call(raw, timeout=10))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (method.name, code)
    assert {"GetAdapter", "LocateAdapter", "RegisterWorker", "Heartbeat", "DeleteAdapter"} <= set(tried)
    reg = registry_pb2_grpc.AdapterRegistryStub(channel)
    place = placement_pb2_grpc.PlacementStub(channel)
    for ref in ("a@²", "a@١", "a@" + "9" * 5000, "a\n", "a@prod\n"):
        assert _code(lambda ref=ref: reg.GetAdapter(rp.GetAdapterRequest(adapter=ref), timeout=10)) == (
            grpc.StatusCode.INVALID_ARGUMENT
        ), ref
        locate = placement_pb2.LocateAdapterRequest(adapter=ref)
        assert _code(lambda locate=locate: place.LocateAdapter(locate, timeout=10)) == (
            grpc.StatusCode.INVALID_ARGUMENT
        ), ref
