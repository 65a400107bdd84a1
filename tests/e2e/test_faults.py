"""Faults with real processes: kill -9 a worker mid-stream (its client gets UNAVAILABLE, the other
worker's stream completes, new requests are served, the dead worker's placements are cleaned up)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from loraserve.client.registry_client import RegistryClient
from loraserve.client.sdk import Client
from loraserve.common.errors import LoraserveError
from loraserve.common.processes import ServerProcess
from loraserve.registry.config import RegistryConfig
from tests.conftest import with_test_xla_flags
from tests.e2e.procs import loraserve_process, wait_for_workers, wait_healthy
from tests.registry.conftest import start_registry

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
# docker-compose's worker shapes (tests/e2e/test_system.py and others start the same): the warm-up's programs
# come from the shared compilation cache when another test compiled them first
SHAPES = ["--max-seq-len", "64", "--max-loras", "2", "--max-lora-rank", "8"]
TOKENS = 60  # the prompt's token and 60 new ones fit the 64-token context


class Drained:
    """A stream read to its end on a thread: its chunks so far, then the error that ended it (if any)."""

    def __init__(self, first, stream: Iterator) -> None:
        self.chunks, self.error, self._stream = [first], None, stream
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for chunk in self._stream:
                self.chunks.append(chunk)
        except LoraserveError as exc:
            self.error = exc

    @property
    def finished(self) -> bool:
        return bool(self.chunks[-1].finish_reason)

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive()


def _started_then_frozen(proc: ServerProcess, stream: Iterator) -> Drained:
    """The stream's first chunk, then SIGSTOP its worker at once: the rest of the stream waits for SIGCONT."""
    first = next(stream)
    os.kill(proc.popen.pid, signal.SIGSTOP)
    assert first.token_ids
    return Drained(first, stream)


def _resume(*procs: ServerProcess) -> None:
    for proc in procs:
        if proc.popen.poll() is None:
            os.kill(proc.popen.pid, signal.SIGCONT)


def test_kill_9_a_worker_mid_stream(llama_dir, adapter_dirs, tmp_path) -> None:
    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"), lease_seconds=2)
    with start_registry(config, str(tmp_path / "s")) as reg:
        reg.client.push(adapter_dirs["all-r4"], "steady", "tiny")
        args = ["worker", "--model", str(llama_dir), "--model-id", "tiny", "--port", "0", "--warmup", "false"]
        args += ["--registry", reg.address, *SHAPES]
        env = with_test_xla_flags()  # compile-bound: the streams are frozen, not long
        with (
            loraserve_process(args, env=env, timeout=300) as a,
            loraserve_process(args, env=env, timeout=300) as b,
            loraserve_process(
                ["router", "serve", "--port", "0", "--registry", reg.address, "--locate-ttl", "0.2"]
            ) as router,
        ):
            for w in (a, b):
                wait_healthy(w.address, timeout=180)
            wait_for_workers(reg.client, 2)
            long = dict(adapter="steady@1", max_tokens=TOKENS, ignore_eos=True)
            # Both streams running: each worker is frozen (SIGSTOP) as soon as its first chunk arrives, so
            # each stream stays unfinished for as long as needed. A stream that finished before its worker
            # froze (a very slow test process) cannot be killed mid-stream: try again.
            for _ in range(5):
                try:
                    doomed = _started_then_frozen(a, Client(a.address).generate([5], **long))
                    survivor = _started_then_frozen(b, Client(b.address).generate([5], **long))
                    time.sleep(0.5)  # what the workers had sent before they froze arrives
                    if not (doomed.finished or survivor.finished):
                        break
                except BaseException:
                    _resume(a, b)
                    raise
                _resume(a, b)
                doomed.join()
                survivor.join()
            else:
                pytest.fail("every try: a stream finished before its worker froze")
            try:
                a.stop(kill=True)  # kill -9, mid-stream
            finally:
                _resume(b)
            doomed.join()
            assert doomed.error is not None and doomed.error.code_name == "UNAVAILABLE"
            survivor.join()
            assert survivor.error is None
            rest = survivor.chunks
            assert rest[-1].finish_reason == "length" and rest[-1].completion_tokens == TOKENS
            with Client(router.address) as client:  # requests that had not started are not lost
                outs = [client.complete([5, 6, 7], adapter="steady", max_tokens=3) for _ in range(6)]
            assert all(o.completion_tokens == 3 for o in outs)
            wait_for_workers(reg.client, 1)
            with RegistryClient(reg.address) as rc:
                workers = rc.workers()
            assert [w.address for w in workers] == [b.address]
            from sqlalchemy import select

            from loraserve.registry.db import PlacementRow, WorkerRow

            with reg.registry.catalog.sessions() as s:
                placed = (
                    s.execute(
                        select(WorkerRow.address).join(PlacementRow, PlacementRow.worker_id == WorkerRow.id)
                    )
                    .scalars()
                    .all()
                )
            assert set(placed) == {b.address}  # the dead worker holds nothing any more
