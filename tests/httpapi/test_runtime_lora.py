"""vLLM's runtime LoRA API on a real worker (what llm-d's adapter rollouts call): ``POST /v1/load_lora_adapter``
with a ``lora_path`` under an allowed prefix registers and loads the adapter, which then serves; a path outside
every prefix, or any path on a registry-backed worker, is 403 with nothing registered; unknown names are 404;
``/v1/unload_lora_adapter`` frees the slot after the requests using it finish; with tokens, only the admin RPCs'
scopes may call them."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from loraserve.common.security import ServerSecurity
from loraserve.httpapi.app import build_app
from loraserve.worker.http_backend import WorkerHttpBackend
from loraserve.worker.server import InferenceServicer
from tests.aio_thread import http_server_thread
from tests.httpapi.conftest import MODEL


@pytest.fixture(scope="module")
def runtime(served, adapter_dirs):
    """The package's worker behind an app that may load adapters from the adapters' parent folder."""
    prefix = str(adapter_dirs["qv-r8-rslora"].parent)
    w = served.worker

    def app():
        backend = WorkerHttpBackend(InferenceServicer(w.engine, w.tokenizer), MODEL, import_prefixes=[prefix])
        return build_app(backend)

    with http_server_thread(app) as port:
        yield f"http://127.0.0.1:{port}", w.engine


def _slots(engine) -> set[str]:
    return {s.adapter for s in engine.snapshot().slots if s.adapter}


def test_load_serve_and_unload_an_adapter_from_an_allowed_path(runtime, adapter_dirs) -> None:
    url, engine = runtime
    path = str(adapter_dirs["qv-r8-rslora"])
    loaded = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "hot-qv", "lora_path": path}, timeout=60
    )
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'hot-qv' added successfully."
    assert "hot-qv" in {a.split("@")[0] for a in _slots(engine)}
    models = {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    assert "hot-qv" in models
    body = {"model": "hot-qv", "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
    # an unload waits for the request decoding with the adapter, which completes all its tokens
    done: dict = {}
    worker = threading.Thread(
        target=lambda: done.update(r=httpx.post(f"{url}/v1/completions", json=body, timeout=60))
    )
    worker.start()
    deadline = time.monotonic() + 60
    while not engine.snapshot().running:  # the request holds the adapter's slot before the unload comes
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.002)
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "hot-qv"}, timeout=60)
    worker.join()
    assert done["r"].status_code == 200 and done["r"].json()["usage"]["completion_tokens"] == 24
    assert (
        unloaded.status_code == 200
        and unloaded.text == "Success: LoRA adapter 'hot-qv' removed successfully."
    )
    assert "hot-qv" not in {a.split("@")[0] for a in _slots(engine)}
    again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "hot-qv"}, timeout=10)
    assert again.status_code == 404 and again.json()["error"]["code"] == "NOT_FOUND"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"lora_name": "outside", "lora_path": "/etc"}, 403, "PERMISSION_DENIED"),
        ({"lora_name": "sneaky", "lora_path": "{parent}/../../etc"}, 403, "PERMISSION_DENIED"),
        ({"lora_name": "remote", "lora_path": "http://169.254.169.254/latest"}, 403, "PERMISSION_DENIED"),
        ({"lora_name": "never-registered"}, 404, "NOT_FOUND"),
        ({"lora_name": ""}, 400, "INVALID_ARGUMENT"),
        ({"lora_name": "x", "unknown": 1}, 400, "INVALID_ARGUMENT"),
    ],
)
def test_bad_loads_are_refused_and_load_nothing(runtime, adapter_dirs, body, status, code) -> None:
    url, engine = runtime
    before = _slots(engine)
    if "lora_path" in body:
        body = {**body, "lora_path": body["lora_path"].format(parent=adapter_dirs["qv-r8-rslora"].parent)}
    refused = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30)
    assert refused.status_code == status and refused.json()["error"]["code"] == code, refused.text
    assert _slots(engine) == before
    if "lora_path" in body:  # a refused path is not registered under the name either
        assert body["lora_name"] not in engine.source.known()


def test_a_registry_backed_worker_takes_no_path_and_tokens_need_the_admin_scope(served, adapter_dirs) -> None:
    security = ServerSecurity(inference_tokens=("inf",), admin_tokens=("adm",))
    w = served.worker

    class RegistryBacked(WorkerHttpBackend):  # its engine's source is not a local one
        async def load_lora(self, name: str, path: str) -> None:
            source, w.engine.source = w.engine.source, object()
            try:
                await super().load_lora(name, path)
            finally:
                w.engine.source = source

    def app():
        return build_app(
            RegistryBacked(InferenceServicer(w.engine, w.tokenizer), MODEL, import_prefixes=["/"]), security
        )

    body = {"lora_name": "x", "lora_path": str(adapter_dirs["all-r4"])}
    with http_server_thread(app) as port:
        url = f"http://127.0.0.1:{port}/v1/load_lora_adapter"
        assert httpx.post(url, json=body, timeout=10).status_code == 401
        inference = httpx.post(url, json=body, headers={"authorization": "Bearer inf"}, timeout=10)
        assert (
            inference.status_code == 403 and "WorkerAdmin/LoadAdapter" in inference.json()["error"]["message"]
        )
        admin = httpx.post(url, json=body, headers={"authorization": "Bearer adm"}, timeout=10)
        assert admin.status_code == 403 and "registry" in admin.json()["error"]["message"]
