"""Registry fixtures: a real registry (SQLite or PostgreSQL + a blob store) behind a real gRPC server.

``reg``'s registry runs on a :class:`~loraserve.registry.clock.ManualClock` (``reg.clock``): its leases end and
its caches' TTLs pass when a test advances that clock, never on their own."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from loraserve.client.registry_client import RegistryClient
from loraserve.registry.app import Registry, open_registry
from loraserve.registry.clock import SYSTEM_CLOCK, Clock, ManualClock
from loraserve.registry.config import RegistryConfig
from loraserve.registry.server import build_server, set_serving
from tests.aio_thread import aio_server_thread

TINY_MODEL = "tiny-llama"


@dataclass
class RegistryEnv:
    address: str
    registry: Registry
    channel: grpc.Channel
    client: RegistryClient
    store_root: str

    @property
    def clock(self) -> ManualClock:
        """The registry's clock, when the test gave it a manual one (``reg`` does)."""
        assert isinstance(self.registry.clock, ManualClock), "this registry runs on the real clock"
        return self.registry.clock

    def adapter_rows(self) -> list[tuple[str, int, str]]:
        from sqlalchemy import select

        from loraserve.registry.db import AdapterRow

        with self.registry.catalog.sessions() as s:
            return [
                (r.name, r.version, r.state) for r in s.scalars(select(AdapterRow).order_by(AdapterRow.id))
            ]

    def blobs(self) -> list[str]:
        return sorted(self.registry.catalog.store.list_blobs())


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    return request.getfixturevalue("postgres_url")


def start_registry(config: RegistryConfig, store_root: str, clock: Clock = SYSTEM_CLOCK):
    """Context manager: the registry of ``config`` served on a free loopback port, on ``clock``."""
    from contextlib import contextmanager

    @contextmanager
    def run() -> Iterator[RegistryEnv]:
        registry = open_registry(config, clock)

        async def build():
            server, port, health_servicer = build_server(registry.catalog, registry.placement, "127.0.0.1:0")
            await set_serving(health_servicer, True)
            return server, port

        try:
            with aio_server_thread(build) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                client = RegistryClient(f"127.0.0.1:{port}", channel=channel)
                yield RegistryEnv(f"127.0.0.1:{port}", registry, channel, client, store_root)
        finally:
            registry.close()

    return run()


@pytest.fixture
def reg(db_url: str, tmp_path: Path) -> Iterator[RegistryEnv]:
    store = str(tmp_path / "store")
    config = RegistryConfig(
        db=db_url, storage=store, lease_seconds=2, max_lora_rank=16, max_upload_bytes=4 << 20
    )
    with start_registry(config, store, ManualClock()) as env:
        yield env


@pytest.fixture(scope="session")
def tiny_shapes(llama_dir) -> dict[str, tuple[int, int, int]]:
    from loraserve.models.checkpoint import read_config
    from loraserve.models.config import ModelConfig

    cfg = ModelConfig.from_hf(read_config(str(llama_dir)))
    # what a worker registers: the projections and the vocabulary-sized targets (embed_tokens, lm_head)
    return {m: (i, o, cfg.num_layers) for m, (i, o) in cfg.adapter_shapes().items()}
