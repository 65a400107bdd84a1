"""Router configuration: a frozen dataclass read from flags or ``LORASERVE_ROUTER_*`` environment variables."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraserve.common.config import InferenceSecurityConfig, config_from_env

if TYPE_CHECKING:
    from loraserve.router.routing import WorkerLimits

ENV_PREFIX = "LORASERVE_ROUTER_"


@dataclass(frozen=True)
class RouterConfig(InferenceSecurityConfig):
    """Also ``auth_tokens``, ``admin_tokens`` and the TLS fields from ``InferenceSecurityConfig``."""

    registry: str = "127.0.0.1:50051"  # host:port of the registry (LocateAdapter)
    host: str = "127.0.0.1"
    port: int = 50071
    locate_ttl: float = 1.0  # seconds a LocateAdapter answer is reused
    max_candidates: int = 3  # workers tried, best first, before giving up with UNAVAILABLE
    metrics_port: int = 0  # Prometheus /metrics port (0 = off)
    http_port: int = 0  # OpenAI-compatible HTTP API (+ /metrics, /health) on host:http_port (0 = off)
    max_concurrency: int = 1024  # streams in flight; more get RESOURCE_EXHAUSTED at once
    registry_token: str = ""  # token presented to the registry
    worker_token: str = ""  # token presented to the workers
    upstream_tls_ca: str = ""  # PEM CA of the registry's and workers' certificates
    worker_timeout: float = 600.0  # deadline of a call to a worker when the client set none (0 = none)
    worker_first_token_timeout: float = 120.0  # no first message this long: try the next worker (0 = off)
    worker_stall_timeout: float = 30.0  # no message this long after the first: UNAVAILABLE (0 = off)
    upstream_keepalive: float = 10.0  # keepalive ping interval to the registry and workers (0 = off; >= 5)

    def __post_init__(self) -> None:
        from loraserve.common.server import MIN_PING_INTERVAL_S  # here: `loraserve --help` stays light

        names = ("worker_timeout", "worker_first_token_timeout", "worker_stall_timeout", "upstream_keepalive")
        for name in names:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
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
