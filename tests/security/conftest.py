"""The registry fixtures (a live registry on SQLite and PostgreSQL) are shared with these tests."""

from tests.registry.conftest import db_url, reg  # noqa: F401 - pytest fixtures, used by name
