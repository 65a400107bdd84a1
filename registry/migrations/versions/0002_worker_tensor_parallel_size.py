"""Workers record their tensor-parallel size (devices one model is split over).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:  # batch: SQLite cannot alter tables in place
        batch.add_column(sa.Column("tensor_parallel_size", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("tensor_parallel_size")
