"""The registry fixtures (a live registry on SQLite and PostgreSQL) are shared with these tests, and so are the
hostile-request tests' worker and router processes (``fake_servers``), started once for the package."""

import pytest

from tests.registry.conftest import db_url, reg  # noqa: F401 - pytest fixtures, used by name

HOSTILE_CONTEXT = 128  # the fake worker's max_seq_len


@pytest.fixture(scope="package")
def hostile_stack(tmp_path_factory):
    """(worker, router): ``tests.security.fake_servers`` processes, the worker's tokenizer a real byte-level
    BPE and its context ``HOSTILE_CONTEXT`` tokens."""
    from loraserve.testing import build_tokenizer
    from tests.security.fake_servers import fake_stack

    tok = tmp_path_factory.mktemp("hostile-tokenizer")
    build_tokenizer(tok)
    with fake_stack(tok, HOSTILE_CONTEXT) as servers:
        yield servers
