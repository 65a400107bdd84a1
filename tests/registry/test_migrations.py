"""The Alembic migrations build exactly the schema the typed models describe (SQLite and PostgreSQL): a new
table or column in ``registry/db.py`` without its migration (or the reverse) fails here."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from loraserve.registry import migrate
from loraserve.registry.db import Base


def test_migrations_at_head_match_the_models(db_url: str) -> None:
    migrate.upgrade(db_url)
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()
    assert diff == []
    assert migrate.current_revision(db_url) == "0005"
