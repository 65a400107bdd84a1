"""Router configuration: a frozen dataclass read from flags or ``LORASERVE_ROUTER_*`` environment variables."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from loraserve.common.addresses import LISTEN_HELP, check_listen_flags
from loraserve.common.config import SECURITY, InferenceSecurityConfig, config_from_env, opt

if TYPE_CHECKING:
    from loraserve.router.routing import WorkerLimits

ENV_PREFIX = "LORASERVE_ROUTER_"

SERVING, UPSTREAM = "serving", "upstream"


@dataclass(frozen=True)
class RouterConfig(InferenceSecurityConfig):
    """Also ``auth_tokens``, ``admin_tokens`` and the TLS fields from ``InferenceSecurityConfig``."""

    GROUPS: ClassVar[dict[str, str]] = {
        SERVING: "address, ports, metrics and admission",
        UPSTREAM: "the registry and the workers: lookups, deadlines, keepalive",
        SECURITY: "tokens and TLS (docs/security.md)",
    }

    registry: str = opt(
        "127.0.0.1:50051", "registry address (LocateAdapter): host:port or unix:PATH", UPSTREAM
    )
    host: str = opt(
        "127.0.0.1", "interface to bind: the gRPC port (unless --listen) and --http-port", SERVING
    )
    port: int = opt(50071, "port to bind (0 picks a free one)", SERVING)
    listen: str = opt("", LISTEN_HELP, SERVING)
    locate_ttl: float = opt(1.0, "seconds a LocateAdapter answer is reused", UPSTREAM)
    max_candidates: int = opt(3, "workers tried, best first, before giving up with UNAVAILABLE", UPSTREAM)
    metrics_port: int = opt(0, "Prometheus /metrics port (0 = off)", SERVING)
    http_port: int = opt(
        0,
        "OpenAI-compatible HTTP API port, also serving /health, and /metrics when there is no --metrics-port"
        " (0 = off)",
        SERVING,
    )
    max_concurrency: int = opt(
        1024, "requests in the router (streams and queued); more get RESOURCE_EXHAUSTED at once", SERVING
    )
    max_queued: int = opt(
        1024,
        "requests that wait, first come first served, for a place when the workers are full (0 = refuse"
        " them at once); more get RESOURCE_EXHAUSTED at once",
        SERVING,
    )
    max_queue_wait: float = opt(
        30.0, "seconds a request may wait in that queue before RESOURCE_EXHAUSTED", SERVING
    )
    registry_token: str = opt("", "bearer token presented to the registry", SECURITY)
    worker_token: str = opt("", "bearer token presented to the workers", SECURITY)
    upstream_tls_ca: str = opt("", "PEM CA of the registry's and workers' certificates", SECURITY)
    worker_timeout: float = opt(
        600.0, "seconds a call to a worker may last when the client set no deadline (0 = no limit)", UPSTREAM
    )
    worker_first_token_timeout: float = opt(
        120.0,
        "seconds to wait for a worker's first message before trying the next worker (0 = no limit)",
        UPSTREAM,
    )
    worker_stall_timeout: float = opt(
        30.0,
        "seconds a worker may send nothing after its first message before the stream fails UNAVAILABLE (0 = no"
        " limit)",
        UPSTREAM,
    )
    upstream_keepalive: float = opt(
        10.0,
        "seconds between keepalive pings to the registry and workers; a ping unanswered as long drops the"
        " connection (0 = off, else >= 5)",
        UPSTREAM,
    )

    def __post_init__(self) -> None:
        from loraserve.common.server import MIN_PING_INTERVAL_S  # here: `loraserve --help` stays light

        check_listen_flags(self.listen, self.host)
        names = (
            "worker_timeout",
            "worker_first_token_timeout",
            "worker_stall_timeout",
            "upstream_keepalive",
            "max_queue_wait",
        )
        for name in names:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued!r}")
        if 0 < self.upstream_keepalive < MIN_PING_INTERVAL_S:  # servers refuse more frequent pings (GOAWAY)
            raise ValueError(
                f"upstream_keepalive must be 0 (off) or >= {MIN_PING_INTERVAL_S:g} s, the most often a loraserve "
                f"server accepts pings; got {self.upstream_keepalive!r}"
            )

    def worker_limits(self) -> WorkerLimits:
        from loraserve.router.routing import WorkerLimits

        return WorkerLimits(
            self.worker_timeout,
            self.worker_first_token_timeout,
            self.worker_stall_timeout,
            self.upstream_keepalive,
        )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> RouterConfig:
        return config_from_env(cls, ENV_PREFIX, env, overrides)
