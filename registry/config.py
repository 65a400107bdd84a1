"""Registry configuration: a frozen dataclass read from flags or ``LORASERVE_REGISTRY_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.common.config import ServerSecurityConfig, config_from_env

ENV_PREFIX = "LORASERVE_REGISTRY_"


@dataclass(frozen=True)
class RegistryConfig(ServerSecurityConfig):
    """Also ``admin_tokens`` and ``tls_cert``/``tls_key``/``tls_client_ca`` from ``ServerSecurityConfig``."""

    db: str = "sqlite:///loraserve-registry.db"  # any SQLAlchemy URL
    storage: str = "./loraserve-store"  # fsspec root URL for adapter blobs
    host: str = "127.0.0.1"
    port: int = 50051
    lease_seconds: int = 15  # a worker that misses heartbeats this long loses its placements
    max_upload_bytes: int = 1 << 30
    # uploads and imports in flight at once (each spools to a local temporary file and is validated tensor by
    # tensor: a few MiB of memory each); one more is refused with RESOURCE_EXHAUSTED, never queued
    max_concurrent_uploads: int = 2
    max_lora_rank: int = 256  # largest rank accepted at upload (the largest slot rank of the fleet)
    migrate: bool = True  # run migrations at start
    metrics_port: int = 0  # Prometheus /metrics port (0 = off)
    import_allow: str = (
        ""  # comma-separated URL prefixes ImportAdapter may read (empty = the storage root only)
    )

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        if self.max_concurrent_uploads < 1:
            raise ValueError(f"max_concurrent_uploads must be >= 1, got {self.max_concurrent_uploads!r}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> RegistryConfig:
        return config_from_env(cls, ENV_PREFIX, env, overrides)
