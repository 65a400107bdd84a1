"""Running caps per adapter name or tenant (``running_limits``, registry.running_limits): how many requests of
one adapter, or of one tenant's adapters, each worker runs at once.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "running_limits",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("max_running", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(256), nullable=False, server_default=""),
        sa.UniqueConstraint("kind", "key", name="uq_running_limits_kind_key"),
    )


def downgrade() -> None:
    op.drop_table("running_limits")
