"""Workers record the sha256 of their process's instance id (``workers.identity``): while a worker's lease is
live, only the same identity may register at its address again (docs/security.md, "Worker identity").

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:  # batch: SQLite cannot alter tables in place
        batch.add_column(sa.Column("identity", sa.String(64), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("identity")
