"""The PostgreSQL harness itself: a database of its own per test, dropped afterwards."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

pytestmark = pytest.mark.postgres


def test_each_test_gets_its_own_empty_database(postgres_url: str) -> None:
    engine = create_engine(postgres_url)
    try:
        with engine.begin() as conn:
            assert conn.execute(text("SELECT current_database()")).scalar() == make_url(postgres_url).database
            tables = conn.execute(
                text("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'")
            ).scalar()
            assert tables == 0
            conn.execute(text("CREATE TABLE probe (id integer primary key, v text)"))
            conn.execute(text("INSERT INTO probe VALUES (1, 'x')"))
            assert conn.execute(text("SELECT v FROM probe WHERE id = 1")).scalar() == "x"
    finally:
        engine.dispose()


def test_databases_are_dropped_after_use() -> None:
    engine = create_engine(os.environ["LORASERVE_TEST_POSTGRES_URL"])
    try:
        with engine.connect() as conn:
            left = conn.execute(
                text("SELECT datname FROM pg_database WHERE datname LIKE 'loraserve_test_%'")
            ).all()
    finally:
        engine.dispose()
    # Earlier tests in this run have finished; their databases must be gone.
    assert left == []
