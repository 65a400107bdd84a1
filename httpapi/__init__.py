"""The OpenAI-compatible HTTP API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``), served by the
router and the workers next to their gRPC port (``--http-port``). Needs the ``http`` extra (FastAPI, uvicorn)."""

from __future__ import annotations

from typing import Any


def http_server(backend: Any, host: str, port: int, security: Any, metrics: bool = True) -> Any:
    """An ``HttpServer`` (port bound now) serving ``backend`` with the server's tokens and TLS (and ``/metrics``
    when ``metrics``: servers with a metrics port serve them there only); a clear FAILED_PRECONDITION when the
    ``http`` extra is not installed."""
    from loraserve.common.errors import FailedPrecondition

    try:
        from loraserve.httpapi.app import build_app
        from loraserve.httpapi.server import HttpServer
    except ModuleNotFoundError as exc:
        raise FailedPrecondition(
            f"--http-port needs the http extra: pip install 'loraserve[http]' ({exc.name} is missing)"
        ) from None
    return HttpServer(build_app(backend, security, metrics=metrics), host, port, security)
