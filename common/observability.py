"""Prometheus metrics and JSON logs for every loraserve server (worker, registry, router).

Each server process exposes ``/metrics`` on ``--metrics-port`` (0 = off) and logs one JSON object per
line when ``LORASERVE_LOG_FORMAT=json``: time, level, logger, message, and ``request_id`` / ``adapter``
/ ``worker`` when the log call passes them in ``extra``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from prometheus_client import Counter, Histogram, start_http_server

from loraserve.common.errors import Unavailable

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

RPCS = Counter(
    "loraserve_rpc_requests_total",
    "RPCs handled, by server, method and status code",
    ["server", "method", "code"],
)
RPC_SECONDS = Histogram(
    "loraserve_rpc_seconds",
    "RPC handling time (unary) or stream duration",
    ["server", "method"],
    buckets=LATENCY_BUCKETS,
)
TTFT = Histogram(
    "loraserve_time_to_first_token_seconds",
    "Time from request arrival to its first token",
    ["server"],
    buckets=LATENCY_BUCKETS,
)
ITL = Histogram(
    "loraserve_inter_token_latency_seconds",
    "Time between two streamed chunks",
    ["server"],
    buckets=LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter("loraserve_prompt_tokens_total", "Prompt tokens of finished requests", ["server"])
GENERATION_TOKENS = Counter("loraserve_generation_tokens_total", "Generated tokens streamed", ["server"])


class StreamTimer:
    """Observes TTFT, inter-token latency and token counts of one streamed request."""

    def __init__(self, server: str) -> None:
        self.server, self.start, self.last = server, time.perf_counter(), None

    def chunk(self, tokens: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            TTFT.labels(self.server).observe(now - self.start)
        else:
            ITL.labels(self.server).observe(now - self.last)
        self.last = now
        GENERATION_TOKENS.labels(self.server).inc(tokens)

    def done(self, prompt_tokens: int) -> None:
        PROMPT_TOKENS.labels(self.server).inc(prompt_tokens)


def observe_rpc(server: str, method: str, code: str, started: float) -> None:
    RPCS.labels(server, method, code).inc()
    RPC_SECONDS.labels(server, method).observe(time.perf_counter() - started)


def start_metrics(port: int, log: logging.Logger | None = None) -> int:
    """Serve /metrics on ``port`` (0 = off); returns the port."""
    if port:
        try:
            start_http_server(port)
        except OSError as exc:
            raise Unavailable(f"cannot serve /metrics on port {port}: {exc}") from exc
        (log or logging.getLogger("loraserve")).info("metrics on :%d/metrics", port)
    return port


class JsonFormatter(logging.Formatter):
    FIELDS = ("request_id", "adapter", "worker")

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in self.FIELDS:
            if hasattr(record, name):
                out[name] = getattr(record, name)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stderr`` is when a record is written, not the stream it was made
    with (a plain one keeps writing to a redirected or captured stream after it is closed, e.g. a test's)."""

    @property
    def stream(self):  # the logging module reads and writes this attribute
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: str = "INFO", fmt: str | None = None) -> None:
    """Text logs by default; JSON lines when ``fmt`` or ``LORASERVE_LOG_FORMAT`` is "json"."""
    fmt = fmt or os.environ.get("LORASERVE_LOG_FORMAT", "text")
    handler = StderrHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
        handler.formatter.converter = time.gmtime
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
