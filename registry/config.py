"""Registry configuration: a frozen dataclass read from flags or ``LORASERVE_REGISTRY_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from loraserve.common.addresses import LISTEN_HELP, check_listen_flags
from loraserve.common.config import SECURITY, ServerSecurityConfig, config_from_env, opt

ENV_PREFIX = "LORASERVE_REGISTRY_"

STORAGE, UPLOADS, SERVING = "storage", "uploads", "serving"


@dataclass(frozen=True)
class RegistryConfig(ServerSecurityConfig):
    """Also ``admin_tokens`` and ``tls_cert``/``tls_key``/``tls_client_ca`` from ``ServerSecurityConfig``."""

    GROUPS: ClassVar[dict[str, str]] = {
        STORAGE: "the database and the blob store",
        UPLOADS: "what uploads and imports may be",
        SERVING: "address, port, metrics and worker leases",
        SECURITY: "tokens and TLS (docs/security.md)",
    }

    db: str = opt(
        "sqlite:///loraserve-registry.db",
        "SQLAlchemy URL of the database (a SQLite file by default, postgresql+psycopg://… in production)",
        STORAGE,
    )
    storage: str = opt(
        "./loraserve-store",
        "fsspec root URL for adapter weights (a folder, memory://…, gs://bucket/prefix)",
        STORAGE,
    )
    host: str = opt("127.0.0.1", "interface to bind (unless --listen)", SERVING)
    port: int = opt(50051, "port to bind (0 picks a free one)", SERVING)
    listen: str = opt("", LISTEN_HELP, SERVING)
    lease_seconds: int = opt(15, "a worker that misses heartbeats this long loses its placements", SERVING)
    max_upload_bytes: int = opt(1 << 30, "largest adapter weights file accepted", UPLOADS)
    max_concurrent_uploads: int = opt(
        2,
        "uploads and imports in flight at once (each spools to a local temporary file and is validated tensor"
        " by tensor: a few MiB of memory each); one more is refused with RESOURCE_EXHAUSTED (retry later),"
        " never queued",
        UPLOADS,
    )
    max_lora_rank: int = opt(
        256, "largest adapter rank accepted at upload (the largest slot rank of the fleet)", UPLOADS
    )
    migrate: bool = opt(True, "run database migrations at start", STORAGE)
    metrics_port: int = opt(0, "Prometheus /metrics port (0 = off)", SERVING)
    import_allow: str = opt(
        "",
        "comma-separated URL prefixes ImportAdapter may read from; anything else is PERMISSION_DENIED (empty:"
        " the storage root only)",
        UPLOADS,
    )

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        check_listen_flags(self.listen, self.host)
        if self.max_concurrent_uploads < 1:
            raise ValueError(f"max_concurrent_uploads must be >= 1, got {self.max_concurrent_uploads!r}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> RegistryConfig:
        return config_from_env(cls, ENV_PREFIX, env, overrides)
