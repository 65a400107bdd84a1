"""docs/design.md §8 row by row over real servers (registry, worker, router on loopback, tokens on), plus the
bad inputs of the reliability issue. Every case asserts the status code AND that nothing was stored and
the system still serves a normal request afterwards."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import fsspec
import pytest
from sqlalchemy import func, select

from loraserve.client.registry_client import RegistryClient
from loraserve.client.sdk import Client
from loraserve.common.errors import LoraserveError
from loraserve.common.security import ServerSecurity
from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.models.checkpoint import load_checkpoint
from loraserve.registry.app import open_registry
from loraserve.registry.config import RegistryConfig
from loraserve.registry.db import AdapterRow
from loraserve.registry.server import build_server as build_registry
from loraserve.router.routing import Locator, WorkerPool
from loraserve.router.server import build_server as build_router
from loraserve.worker.registration import Registration
from loraserve.worker.registry_source import RegistryAdapterSource
from loraserve.worker.server import build_server as build_worker
from loraserve.worker.tokenizer import load_tokenizer
from tests.aio_thread import aio_server_thread
from tests.e2e.procs import wait_for_workers
from tests.engines import started_engine

ADMIN, INFER, MODEL = "admin-t", "infer-t", "tiny-llama"
PROMPT = [5, 17, 33, 100, 7]


class Env:
    pass


@pytest.fixture(scope="module")
def env(llama_dir, adapter_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("table")
    e = Env()
    with ExitStack() as es:
        e.registry = open_registry(
            RegistryConfig(
                db=f"sqlite:///{tmp / 'r.db'}",
                storage=str(tmp / "store"),
                lease_seconds=3,
                max_lora_rank=64,
                max_upload_bytes=1 << 20,
            )
        )
        es.callback(e.registry.close)
        admin_only = ServerSecurity(admin_tokens=(ADMIN,))

        async def registry():
            server, port, _ = build_registry(
                e.registry.catalog, e.registry.placement, "127.0.0.1:0", admin_only
            )
            return server, port

        e.registry_address = f"127.0.0.1:{es.enter_context(aio_server_thread(registry))}"
        e.admin = es.enter_context(RegistryClient(e.registry_address, token=ADMIN))
        for name in ("all-r4", "mlp-r16", "qv-r8-rslora"):
            e.admin.push(adapter_dirs[name], name, MODEL)
        e.cache_dir = tmp / "disk-cache"
        source = RegistryAdapterSource(e.registry_address, cache_dir=str(e.cache_dir), token=ADMIN)
        config = EngineConfig(
            max_batch_size=4, max_seq_len=64, max_loras=2, max_lora_rank=8, min_prefill_bucket=64
        )
        e.engine = es.enter_context(started_engine(llama_dir, config, source=source))
        tokenizer = load_tokenizer(str(llama_dir))
        both = ServerSecurity(inference_tokens=(INFER,), admin_tokens=(ADMIN,))

        async def worker():
            import asyncio

            server, port, _ = build_worker(e.engine, tokenizer, MODEL, "127.0.0.1:0", both)
            e.worker_address = f"127.0.0.1:{port}"
            e.registration = Registration(e.engine, e.registry_address, e.worker_address, MODEL, token=ADMIN)
            e.task = asyncio.get_running_loop().create_task(e.registration.run())
            return server, port

        es.enter_context(aio_server_thread(worker))

        def router_thread(limit: int):
            async def router():
                server, port, _ = build_router(
                    Locator(e.registry_address, 0.2, 3, token=ADMIN),
                    WorkerPool(token=INFER),
                    "127.0.0.1:0",
                    both,
                    max_concurrency=limit,
                )
                return server, port

            return f"127.0.0.1:{es.enter_context(aio_server_thread(router))}"

        e.router = router_thread(64)
        e.full_router = router_thread(0)  # admits nothing: every request is over the limit
        wait_for_workers(e.admin, 1)
        yield e


def _rows(e) -> int:
    with e.registry.catalog.sessions() as s:
        return s.scalar(select(func.count()).select_from(AdapterRow))


def _generate_code(address: str, token: str = INFER, timeout: float = 30, **kw) -> str:
    prompt = kw.pop("prompt", PROMPT)
    try:
        Client(address, token=token, timeout=timeout).complete(prompt, **kw)
    except LoraserveError as exc:
        return exc.code_name
    return "OK"


GENERATE_CASES = [
    ("empty prompt", dict(prompt=[]), "INVALID_ARGUMENT"),
    ("empty text", dict(prompt=""), "INVALID_ARGUMENT"),
    ("prompt over the context", dict(prompt=[5] * 64), "INVALID_ARGUMENT"),
    ("token outside the vocabulary", dict(prompt=[5, 10**6]), "INVALID_ARGUMENT"),
    ("negative temperature", dict(temperature=-0.5), "INVALID_ARGUMENT"),
    ("NaN temperature", dict(temperature=math.nan), "INVALID_ARGUMENT"),
    ("top_p above 1", dict(top_p=1.5), "INVALID_ARGUMENT"),
    ("NaN top_p", dict(top_p=math.nan), "INVALID_ARGUMENT"),
    ("negative stop token", dict(stop_token_ids=[-1]), "INVALID_ARGUMENT"),
    ("unknown adapter", dict(adapter="never-pushed"), "NOT_FOUND"),
    ("unknown version", dict(adapter="all-r4@9"), "NOT_FOUND"),
    ("10 000-character name", dict(adapter="a" * 10_000), "INVALID_ARGUMENT"),
    ("unicode name", dict(adapter="adaptér"), "INVALID_ARGUMENT"),
    ("path traversal name", dict(adapter="../etc/passwd"), "INVALID_ARGUMENT"),
    ("adapter too large for this worker", dict(adapter="mlp-r16"), "FAILED_PRECONDITION"),
    ("message over the size limit", dict(prompt="x" * (5 << 20)), "RESOURCE_EXHAUSTED"),
]


@pytest.mark.parametrize(("case", "kwargs", "code"), GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_generate_errors_through_the_router(env, case, kwargs, code) -> None:
    assert _generate_code(env.router, **kwargs) == code
    assert _generate_code(env.router, adapter="all-r4", max_tokens=2) == "OK"  # nothing else was harmed
    # a refused adapter is never loaded
    assert all(s.adapter != "mlp-r16@1" for s in env.engine.snapshot().slots)


def test_admission_deadline_and_auth(env) -> None:
    assert _generate_code(env.full_router) == "RESOURCE_EXHAUSTED"
    assert (
        _generate_code(env.router, timeout=0.01, max_tokens=58, ignore_eos=True, prompt=[5])
        == "DEADLINE_EXCEEDED"
    )
    assert _generate_code(env.router, token="") == "UNAUTHENTICATED"
    assert _generate_code(env.router, token="wrong") == "UNAUTHENTICATED"
    assert _generate_code(env.worker_address, token="") == "UNAUTHENTICATED"
    with RegistryClient(env.registry_address, token=INFER) as client, pytest.raises(LoraserveError) as exc:
        list(client.list())  # an inference token opens no admin RPC
    assert exc.value.code_name == "UNAUTHENTICATED"
    # the expired request may still be on its way to the worker (router hop) or queued there when the client
    # gives up: wait until the worker has dropped it, and fail if it never does
    deadline = time.time() + 5
    while (env.engine.snapshot().running or env.engine.snapshot().waiting) and time.time() < deadline:
        time.sleep(0.02)
    snap = env.engine.snapshot()
    assert (snap.running, snap.waiting) == (0, 0)  # the expired and refused requests left nothing behind


def test_registry_rows_of_the_table(env, adapter_dirs, tmp_path) -> None:
    before = (_rows(env), sorted(env.registry.catalog.store.list_blobs()))
    with pytest.raises(LoraserveError) as exc:
        env.admin.push(adapter_dirs["all-r4"], "all-r4", MODEL, version=1)
    assert exc.value.code_name == "ALREADY_EXISTS"
    for bad in ("a" * 10_000, "Ünïcode", "a/b", ".."):
        with pytest.raises(LoraserveError) as exc:
            env.admin.push(adapter_dirs["all-r4"], bad, MODEL)
        assert exc.value.code_name == "INVALID_ARGUMENT", bad
    env.registry.catalog.max_upload_bytes = 100
    try:
        with pytest.raises(LoraserveError) as exc:
            env.admin.push(adapter_dirs["all-r4"], "too-big", MODEL)
        assert exc.value.code_name == "RESOURCE_EXHAUSTED"
    finally:
        env.registry.catalog.max_upload_bytes = 1 << 20
    assert (_rows(env), sorted(env.registry.catalog.store.list_blobs())) == before


def test_no_worker_for_the_base_model_is_unavailable(env, adapter_dirs) -> None:
    env.admin.push(adapter_dirs["all-r4"], "orphan-model-adapter", "a-model-nobody-serves")
    assert _generate_code(env.router, adapter="orphan-model-adapter") == "UNAVAILABLE"


def test_corrupted_blob_is_data_loss_and_never_loaded(env, adapter_dirs, tmp_path) -> None:
    folder = tmp_path / "unique"
    import shutil

    shutil.copytree(adapter_dirs["qv-r8-rslora"], folder)
    (folder / "adapter_config.json").write_text(
        (folder / "adapter_config.json").read_text().replace('"r": 8', '"r": 8 ')
    )
    from safetensors.numpy import load_file, save_file

    t = load_file(str(folder / "adapter_model.safetensors"))
    k = sorted(t)[0]
    t[k] = t[k] * 1.5  # new bytes, new blob
    save_file(t, str(folder / "adapter_model.safetensors"))
    a = env.admin.push(folder, "soon-corrupt", MODEL)
    with fsspec.open(a.uri, "wb") as f:
        f.write(b"\0" * a.size_bytes)
    assert _generate_code(env.router, adapter="soon-corrupt") == "DATA_LOSS"
    assert all(not s.adapter.startswith("soon-corrupt") for s in env.engine.snapshot().slots)


def test_deleted_adapter_in_flight(env) -> None:
    """Delete means gone: after one heartbeat (lease 3 s: one a second) the worker refuses the deleted version
    asked directly too, by version or by name (NOT_FOUND), and holds no copy of it; a request already
    decoding on it when the delete came finishes with all its tokens."""
    assert _generate_code(env.router, adapter="qv-r8-rslora", max_tokens=2) == "OK"
    assert any(s.adapter == "qv-r8-rslora@1" for s in env.engine.snapshot().slots)
    blob = env.cache_dir / env.admin.get("qv-r8-rslora@1").sha256
    assert blob.exists()  # the worker's disk cache holds it
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(
            Client(env.worker_address, token=INFER, timeout=60).complete,
            PROMPT,
            adapter="qv-r8-rslora@1",
            max_tokens=40,
            ignore_eos=True,
        )
        while not any(s.adapter == "qv-r8-rslora@1" and s.refcount for s in env.engine.snapshot().slots):
            time.sleep(0.01)
        env.admin.delete("qv-r8-rslora")
        time.sleep(0.3)  # the router's cached route expires
        assert _generate_code(env.router, adapter="qv-r8-rslora") == "NOT_FOUND"
        heartbeats = env.registration.heartbeats
        while env.registration.heartbeats < heartbeats + 2:  # the next heartbeat carries the unload order
            time.sleep(0.05)
        for ref in ("qv-r8-rslora@1", "qv-r8-rslora"):
            assert _generate_code(env.worker_address, adapter=ref) == "NOT_FOUND", ref
        done = long.result(60)
    assert len(done.token_ids) == 40 and done.finish_reason == "length"
    deadline = time.time() + 5
    while any(s.adapter == "qv-r8-rslora@1" for s in env.engine.snapshot().slots) and time.time() < deadline:
        time.sleep(0.05)
    snap = env.engine.snapshot()
    assert all(s.adapter != "qv-r8-rslora@1" for s in snap.slots) and "qv-r8-rslora@1" not in snap.host_tier
    assert not blob.exists() and "qv-r8-rslora@1" not in env.engine.source.disk_keys()
    assert _generate_code(env.router, adapter="all-r4", max_tokens=2) == "OK"


def test_unhealthy_worker_before_warmup_is_unavailable(llama_dir) -> None:
    engine = Engine(
        load_checkpoint(str(llama_dir)), EngineConfig(max_batch_size=1, max_seq_len=16, max_loras=1)
    )

    async def build():
        server, port, _ = build_worker(engine, None, MODEL, "127.0.0.1:0")
        return server, port

    with aio_server_thread(build) as port:  # engine never started: still warming up
        assert _generate_code(f"127.0.0.1:{port}", token="") == "UNAVAILABLE"
