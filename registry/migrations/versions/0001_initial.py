"""Initial schema: adapters, base_models, workers, placements, unload_orders.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("base_model", sa.String(512), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("use_rslora", sa.Boolean(), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("config", sa.Text(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("name", "version", name="uq_adapters_name_version"),
    )
    op.create_index("ix_adapters_base_model_name", "adapters", ["base_model", "name"])
    op.create_index("ix_adapters_sha256", "adapters", ["sha256"])
    op.create_table(
        "base_models",
        sa.Column("id", sa.String(512), primary_key=True),
        sa.Column("module_shapes", sa.JSON(), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("address", sa.String(256), nullable=False),
        sa.Column("model_id", sa.String(512), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("max_lora_rank", sa.Integer(), nullable=False),
        sa.Column("max_batch_size", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("lease_expires_at", TS, nullable=False),
        sa.Column("last_heartbeat", TS, nullable=False),
        sa.Column("running", sa.Integer(), nullable=False),
        sa.Column("waiting", sa.Integer(), nullable=False),
        sa.Column("free_slots", sa.Integer(), nullable=False),
        sa.Column("utilization", sa.Float(), nullable=False),
        sa.Column("registered_at", TS, nullable=False),
    )
    op.create_index("ix_workers_model_lease", "workers", ["model_id", "lease_expires_at"])
    op.create_table(
        "placements",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "worker_id", sa.String(64), sa.ForeignKey("workers.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("adapter", sa.String(160), nullable=False),
        sa.Column(
            "adapter_id", sa.Integer(), sa.ForeignKey("adapters.id", ondelete="SET NULL"), nullable=True
        ),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("refcount", sa.Integer(), nullable=False),
        sa.Column("loaded_at", TS, nullable=False),
        sa.Column("last_used", TS, nullable=True),
        sa.UniqueConstraint("worker_id", "slot", name="uq_placements_worker_slot"),
    )
    op.create_index("ix_placements_adapter", "placements", ["adapter"])
    op.create_table(
        "unload_orders",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "worker_id", sa.String(64), sa.ForeignKey("workers.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("adapter", sa.String(160), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("worker_id", "adapter", name="uq_unload_orders_worker_adapter"),
    )


def downgrade() -> None:
    for table in ("unload_orders", "placements", "workers", "base_models", "adapters"):
        op.drop_table(table)
