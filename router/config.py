"""Router configuration: a frozen dataclass read from flags or ``LORASERVE_ROUTER_*`` environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

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
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = type(f.default)(raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
