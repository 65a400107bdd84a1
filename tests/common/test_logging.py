"""``setup_logging``'s handler writes to the ``sys.stderr`` of the moment: a stream it was made under and
that was closed since (a test's capture, a ``redirect_stderr``) is never written to again."""

from __future__ import annotations

import contextlib
import io
import json
import logging

import pytest

from loraserve.common.observability import setup_logging


@pytest.fixture
def root_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:], root.level = handlers, level


def test_records_follow_sys_stderr_after_the_stream_they_were_set_up_under_closes(root_logging) -> None:
    first, second = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(first):
        setup_logging("INFO", "json")
        logging.getLogger("loraserve.test").info("one")
    first.close()  # what pytest does to a finished test's capture
    with contextlib.redirect_stderr(second):
        logging.getLogger("loraserve.test").warning("two")  # a plain StreamHandler raised on the closed one
    (record,) = [json.loads(line) for line in second.getvalue().splitlines()]
    assert (record["level"], record["logger"], record["message"]) == ("WARNING", "loraserve.test", "two")
    assert len(root_logging.handlers) == 1


def test_text_format_by_default(root_logging, monkeypatch) -> None:
    monkeypatch.delenv("LORASERVE_LOG_FORMAT", raising=False)
    out = io.StringIO()
    with contextlib.redirect_stderr(out):
        setup_logging("WARNING")
        logging.getLogger("loraserve.test").info("hidden")
        logging.getLogger("loraserve.test").error("shown %d", 7)
    assert out.getvalue().endswith(" ERROR loraserve.test shown 7\n") and "hidden" not in out.getvalue()
