"""The HTTP ports follow the gRPC rules (docs/security.md): ``/v1/*`` takes the tokens whose scope opens
``Inference.Generate`` (a known token of another scope: 403 PERMISSION_DENIED; missing or unknown: 401);
``/health`` and ``/metrics`` need no token, like probes and the metrics port; and a server with a metrics port
serves ``/metrics`` there only, so its HTTP port (the router's faces clients) publishes no metrics."""

from __future__ import annotations

import urllib.error
import urllib.request

import httpx
import pytest

from loraserve.common.security import (
    ADMIN,
    GENERATE,
    INFERENCE,
    ROUTER,
    SCOPES,
    WORKER,
    ServerSecurity,
    scopes_for,
)
from tests.aio_thread import http_server_thread
from tests.e2e.compose_local import free_port
from tests.e2e.procs import loraserve_process

TOKENS = {INFERENCE: "inference-t", ROUTER: "router-t", WORKER: "worker-t", ADMIN: "admin-t"}
SECURITY = ServerSecurity(
    inference_tokens=(TOKENS[INFERENCE],),
    router_tokens=(TOKENS[ROUTER],),
    worker_tokens=(TOKENS[WORKER],),
    admin_tokens=(TOKENS[ADMIN],),
)
MODEL = "http-scopes-tiny"


@pytest.fixture(scope="module")
def servicer():
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.engine import Engine
    from loraserve.engine.fake_runner import FakeRunner
    from loraserve.worker.server import InferenceServicer
    from tests.worker.fake_engine import TINY

    cfg = EngineConfig(max_batch_size=2, max_seq_len=32, max_loras=2, max_lora_rank=4)
    engine = Engine(None, cfg, None, runner=FakeRunner.for_config(TINY.vocab_size, cfg), model_config=TINY)
    engine.start()
    yield InferenceServicer(engine, None)
    engine.stop()


def _app(servicer, **kw):
    from loraserve.httpapi.app import build_app
    from loraserve.worker.http_backend import WorkerHttpBackend

    return lambda: build_app(WorkerHttpBackend(servicer, MODEL), SECURITY, **kw)


def test_v1_takes_generate_scopes_and_health_and_metrics_need_none(servicer) -> None:
    with http_server_thread(_app(servicer)) as port:
        url = f"http://127.0.0.1:{port}"
        for scope in SCOPES:
            resp = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {TOKENS[scope]}"})
            if scope in scopes_for(GENERATE):
                assert resp.status_code == 200 and resp.json()["data"][0]["id"] == MODEL, scope
            else:
                assert resp.status_code == 403, scope
                error = resp.json()["error"]
                assert (error["code"], error["type"]) == ("PERMISSION_DENIED", "permission_error")
                assert error["message"].startswith(f"token scope {scope} may not call "), error
        for headers in ({}, {"authorization": "Bearer not-a-token"}):
            resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1]}, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "UNAUTHENTICATED"
        assert httpx.get(f"{url}/health").status_code == 200
        assert "loraserve_" in httpx.get(f"{url}/metrics").text  # no token, as on the metrics port


def test_metrics_can_be_left_to_the_metrics_port(servicer) -> None:
    with http_server_thread(_app(servicer, metrics=False)) as port:
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 404
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200


def _get(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("with_metrics_port", [True, False])
def test_the_router_serves_metrics_on_its_metrics_port_only(with_metrics_port: bool) -> None:
    """``loraserve router serve``: with --metrics-port, /metrics on the HTTP port (the clients' front door) is
    404 and the metrics port serves them; without one, the HTTP port does (nothing would, otherwise)."""
    http, metrics = free_port(), free_port()
    args = [
        "router",
        "serve",
        "--port",
        "0",
        "--http-port",
        str(http),
        "--registry",
        f"127.0.0.1:{free_port()}",
    ]
    args += ["--metrics-port", str(metrics)] if with_metrics_port else []
    with loraserve_process(args, env={"LORASERVE_ROUTER_AUTH_TOKENS": "t"}):
        assert _get(f"http://127.0.0.1:{http}/health") == 200
        assert _get(f"http://127.0.0.1:{http}/metrics") == (404 if with_metrics_port else 200)
        if with_metrics_port:
            assert _get(f"http://127.0.0.1:{metrics}/metrics") == 200
