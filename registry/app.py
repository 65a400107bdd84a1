"""Assemble the registry from its configuration: database, blob store, catalog, placement, and its clock
(``registry.clock``: the machine's, or a test's own)."""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.registry.catalog import Catalog
from loraserve.registry.clock import SYSTEM_CLOCK, Clock
from loraserve.registry.config import RegistryConfig
from loraserve.registry.db import make_engine, make_sessionmaker
from loraserve.registry.hot_reads import hot_reads_for
from loraserve.registry.imports import ImportPolicy
from loraserve.registry.migrate import upgrade
from loraserve.registry.placement import Placement
from loraserve.registry.storage import BlobStore


@dataclass
class Registry:
    config: RegistryConfig
    catalog: Catalog
    placement: Placement
    engine: object
    clock: Clock = SYSTEM_CLOCK

    def close(self) -> None:
        self.catalog.hot.close()
        self.engine.dispose()


def open_registry(config: RegistryConfig, clock: Clock = SYSTEM_CLOCK) -> Registry:
    if config.migrate:
        upgrade(config.db)
    engine = make_engine(config.db)
    sessions = make_sessionmaker(engine)
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    reads = make_sessionmaker(autocommit)
    catalog = Catalog(
        sessions,
        BlobStore(config.storage),
        max_upload_bytes=config.max_upload_bytes,
        max_lora_rank=config.max_lora_rank,
        max_concurrent_uploads=config.max_concurrent_uploads,
        imports=ImportPolicy(config.import_allow.split(","), config.storage, config.max_upload_bytes),
        reads=reads,
        hot=hot_reads_for(autocommit),
        clock=clock,
    )
    return Registry(config, catalog, Placement(sessions, catalog, config.lease_seconds, clock), engine, clock)
