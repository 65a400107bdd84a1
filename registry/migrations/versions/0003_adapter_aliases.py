"""Adapter aliases (``name@prod`` -> a version or a weighted split) and their append-only history; other names
of base models (``base_models.aliases``, e.g. Hugging Face repo ids); the adapters each worker holds in host
memory or its disk cache (``workers.cached``) and its per-adapter usage totals (``workers.usage``); versions retired
by an alias move (``adapters.retired``: workers unload them once no request uses them).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapter_aliases",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("alias", sa.String(64), nullable=False),
        sa.Column("targets", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(256), nullable=False, server_default=""),
        sa.Column("generation", sa.Integer(), nullable=False, server_default="0"),
        sa.UniqueConstraint("name", "alias", name="uq_adapter_aliases_name_alias"),
    )
    op.create_table(
        "alias_history",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("alias", sa.String(64), nullable=False),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
        sa.Column("actor", sa.String(256), nullable=False, server_default=""),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_alias_history_name_id", "alias_history", ["name", "id"])
    with op.batch_alter_table("base_models") as batch:  # batch: SQLite cannot alter tables in place
        batch.add_column(sa.Column("aliases", sa.JSON(), nullable=False, server_default="[]"))
    with op.batch_alter_table("workers") as batch:  # adapters in host memory / disk cache, by heartbeat
        batch.add_column(sa.Column("cached", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("usage", sa.JSON(), nullable=False, server_default="{}"))
    with op.batch_alter_table("adapters") as batch:  # retired by an alias move: drained off the workers
        batch.add_column(sa.Column("retired", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("retired")
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("usage")
        batch.drop_column("cached")
    with op.batch_alter_table("base_models") as batch:
        batch.drop_column("aliases")
    op.drop_index("ix_alias_history_name_id", table_name="alias_history")
    op.drop_table("alias_history")
    op.drop_table("adapter_aliases")
