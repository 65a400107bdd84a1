"""The worker record's tensor-parallel size: stored, listed, defaulted for older workers, migrated."""

from __future__ import annotations

import sqlalchemy as sa

from loraserve.protos.v1 import placement_pb2 as pp
from loraserve.registry import migrate
from tests.registry.conftest import TINY_MODEL


def test_register_and_list_keep_tensor_parallel_size(reg, tiny_shapes) -> None:
    placement = reg.client.placement
    placement.RegisterWorker(
        pp.RegisterWorkerRequest(
            address="127.0.0.1:7101", model_id=TINY_MODEL, slots=2, tensor_parallel_size=8
        )
    )
    # a worker from before the field sends 0: recorded as one device
    placement.RegisterWorker(pp.RegisterWorkerRequest(address="127.0.0.1:7102", model_id=TINY_MODEL, slots=2))
    workers = placement.ListWorkers(pp.ListWorkersRequest()).workers
    assert sorted((w.address, w.tensor_parallel_size) for w in workers) == [
        ("127.0.0.1:7101", 8),
        ("127.0.0.1:7102", 1),
    ]


def test_migration_0002_adds_the_column_with_1_for_existing_workers(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    migrate.upgrade(url, "0001")
    engine = sa.create_engine(url)
    now = "2026-12-01 00:00:00"
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO workers (id, address, model_id, slots, max_lora_rank, max_batch_size, state,"
                " lease_expires_at, last_heartbeat, running, waiting, free_slots, utilization, registered_at)"
                " VALUES ('w1', 'h:1', 'm', 4, 16, 8, 'READY', :t, :t, 0, 0, 4, 0.0, :t)"
            ),
            {"t": now},
        )
    migrate.upgrade(url, "0002")
    assert migrate.current_revision(url) == "0002"
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id, tensor_parallel_size FROM workers")).all() == [("w1", 1)]
    migrate.command.downgrade(migrate.alembic_config(url), "0001")
    columns = {c["name"] for c in sa.inspect(sa.create_engine(url)).get_columns("workers")}
    assert "tensor_parallel_size" not in columns and "max_batch_size" in columns
    engine.dispose()


def test_migration_0004_adds_an_empty_identity_for_existing_workers(tmp_path) -> None:
    """Workers registered before identities have none: "" (any live lease of theirs is then kept until it
    ends, docs/security.md); downgrading drops the column."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    migrate.upgrade(url, "0003")
    engine = sa.create_engine(url)
    now = "2026-12-01 00:00:00"
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO workers (id, address, model_id, slots, max_lora_rank, max_batch_size, state,"
                " lease_expires_at, last_heartbeat, running, waiting, free_slots, utilization, registered_at)"
                " VALUES ('w1', 'h:1', 'm', 4, 16, 8, 'READY', :t, :t, 0, 0, 4, 0.0, :t)"
            ),
            {"t": now},
        )
    migrate.upgrade(url, "0004")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id, identity FROM workers")).all() == [("w1", "")]
    migrate.command.downgrade(migrate.alembic_config(url), "0003")
    columns = {c["name"] for c in sa.inspect(sa.create_engine(url)).get_columns("workers")}
    assert "identity" not in columns and "usage" in columns
    engine.dispose()
