"""The PostgreSQL harness itself: a database of its own per test, dropped afterwards."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.conftest import POSTGRES_ENV, fresh_postgres_database

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
    base_url = os.environ[POSTGRES_ENV]
    with fresh_postgres_database(base_url) as url:
        name = make_url(url).database
        user = create_engine(url)
        conn = (
            user.connect()
        )  # a session still open in the database when it is dropped: the drop forces it out
        conn.execute(text("CREATE TABLE probe (id integer)"))
        conn.commit()
        # Only this test's database is looked at: tests in other processes hold theirs meanwhile.
        assert _databases(base_url, name) == [name]
    try:
        assert _databases(base_url, name) == []
    finally:
        user.dispose()


def _databases(base_url: str, name: str) -> list[str]:
    engine = create_engine(base_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT datname FROM pg_database WHERE datname = :n"), {"n": name})
            return [row[0] for row in rows]
    finally:
        engine.dispose()
