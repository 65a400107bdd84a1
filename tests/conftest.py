"""Shared pytest fixtures: PostgreSQL databases of their own, and the marker rules.

A ``postgres`` test runs whenever ``LORASERVE_TEST_POSTGRES_URL`` is set (CI sets it to the local
server) and FAILS, never skips, when the variable is set and the server cannot be reached. Each test
gets a fresh database created for it and dropped afterwards, since the server outlives test runs.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

POSTGRES_ENV = "LORASERVE_TEST_POSTGRES_URL"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(POSTGRES_ENV):
        return
    skip = pytest.mark.skip(reason=f"{POSTGRES_ENV} is not set: no PostgreSQL server to test against")
    for item in items:
        if "postgres" in item.keywords:
            item.add_marker(skip)


def _with_database(url: str, database: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=database).render_as_string(hide_password=False)


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """SQLAlchemy URL of a brand-new PostgreSQL database, dropped after the test."""
    from sqlalchemy import create_engine, text

    base_url = os.environ.get(POSTGRES_ENV)
    if not base_url:
        pytest.skip(f"{POSTGRES_ENV} is not set")
    name = f"loraserve_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    try:
        with admin.connect() as conn:  # an unreachable server raises here: the test fails, never skips
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield _with_database(base_url, name)
    finally:
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            admin.dispose()
