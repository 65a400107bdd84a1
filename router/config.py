"""Router configuration: a frozen dataclass read from flags or ``LORASERVE_ROUTER_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.common.config import InferenceSecurityConfig, config_from_env

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

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> RouterConfig:
        return config_from_env(cls, ENV_PREFIX, env, overrides)
