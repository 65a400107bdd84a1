"""Router configuration: a frozen dataclass read from flags or ``LORASERVE_ROUTER_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from worker.config import config_from_env

ENV_PREFIX = "LORASERVE_ROUTER_"


@dataclass(frozen=True)
class RouterConfig:
    registry: str = "127.0.0.1:50051"  # host:port of the registry (LocateAdapter)
    host: str = "127.0.0.1"
    port: int = 50071
    locate_ttl: float = 1.0  # seconds a LocateAdapter answer is reused
    max_candidates: int = 3  # workers tried, best first, before giving up with UNAVAILABLE
    metrics_port: int = 0  # Prometheus /metrics port (0 = off)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> RouterConfig:
        return config_from_env(cls, ENV_PREFIX, env, overrides)
