"""The engine: one thread that runs the scheduler over a runner (JetStream style), and its public facade.

Other threads talk to it only through ``submit``/``cancel``/``load_adapter``/``unload_adapter``, which
post typed commands to its inbox, and read it only through ``snapshot()``: the thread publishes a new
immutable ``EngineSnapshot`` after every batch of commands and every step. The host side is
``engine.scheduler`` + ``engine.residency``; the device side is a ``engine.runner.Runner``
(``JaxRunner`` unless one is given, e.g. ``FakeRunner`` in scheduler tests).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc

from loraserve.adapters.running_caps import RunningCaps
from loraserve.adapters.sources import AdapterSource, LocalAdapterSource
from loraserve.common.errors import ResourceExhausted
from loraserve.engine.accounting import AdapterAccounting
from loraserve.engine.config import EngineConfig
from loraserve.engine.request import EngineRequest, Failed
from loraserve.engine.residency import Load, Residency, Unload
from loraserve.engine.runner import Runner
from loraserve.engine.scheduler import Scheduler
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.models.config import ModelConfig

if TYPE_CHECKING:
    from loraserve.models.checkpoint import Checkpoint

log = logging.getLogger("loraserve.engine.engine")


def enable_compilation_cache(path: str) -> None:
    """Keep every compiled program in ``path`` (JAX's persistent cache), however quick its compile.

    A worker restarted with the same model and shapes then warms up from disk: 18 s -> 3 s for the
    test model's warm-up (prefill buckets and every decode variant). Call before the first compile.
    """
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class Engine:
    """A continuously batching generation engine over one base model and ``max_loras`` adapter slots.

    ``checkpoint`` may be None when a ``runner`` and its ``model_config`` are given (tests).
    """

    def __init__(
        self,
        checkpoint: Checkpoint | None,
        config: EngineConfig,
        source: AdapterSource | None = None,
        *,
        runner: Runner | None = None,
        model_config: ModelConfig | None = None,
    ) -> None:
        config.check_resolved()  # no auto left (engine.config.resolve_engine_config)
        self.config = config
        if runner is None:
            from loraserve.engine.jax_runner import JaxRunner

            runner = JaxRunner(checkpoint, config)
        self.runner = runner
        self.model_config = model_config or checkpoint.config
        self.source: AdapterSource = source or LocalAdapterSource()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="adapter-loader")
        self.residency = Residency(
            runner, self.source, self.model_config, config, self._post, self._loader.submit
        )
        # running caps from the registry (heartbeats, GetAdapter): a registry source keeps them up to date
        self.caps: RunningCaps = getattr(self.source, "caps", None) or RunningCaps()
        self.scheduler = Scheduler(runner, self.residency, self.model_config, config, caps=self.caps)
        self.kv_publisher = None  # --kv-events: each step's KV events go out in one batch (engine.kv_events)
        if config.kv_events:
            from loraserve.engine.kv_events import Publisher

            self.kv_publisher = Publisher(config.kv_events, config.kv_events_topic)
        self.accounting = AdapterAccounting()  # per-adapter requests, tokens, loads (metrics and heartbeats)
        self.residency.load_recorder = self.accounting.loaded
        self._snapshot = self.scheduler.snapshot()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.ready = threading.Event()

    @property
    def backend(self) -> object:
        return self.runner.backend

    @property
    def load_observer(self) -> Callable[[float], None] | None:
        return self.residency.load_observer

    @load_observer.setter
    def load_observer(self, observer: Callable[[float], None] | None) -> None:
        self.residency.load_observer = observer  # metrics hook: seconds per adapter load

    # ----------------------------------------------------------------- public, any thread
    def start(self, warmup: bool = True) -> None:
        if warmup:
            self.warmup()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        self.ready.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._loader.shutdown(wait=False, cancel_futures=True)
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        self.ready.clear()

    def warmup(self) -> None:
        """Compile every bucketed shape once so that serving never compiles."""
        self.runner.warmup()

    def submit(self, req: EngineRequest) -> None:
        """Queue a request; raises InvalidArgument / ResourceExhausted at once."""
        self._post(self.scheduler.accept(req))

    def refusal(self) -> ResourceExhausted | None:
        """What a request would be refused with now (a full queue), else None: asked before its prompt is
        read, so a refusal costs nothing (``common.admission``). ``submit`` decides for good."""
        return self.scheduler.refusal()

    def cancel(self, request_id: str, reason: str = "client") -> None:
        """End ``request_id`` at the next command the engine thread reads (the step in flight is read first);
        ``reason``: ``client``, ``deadline`` or ``stop_string`` (``scheduler.Cancel``)."""
        self._post(self.scheduler.cancelling(request_id, reason))

    def load_adapter(self, ref: str, pin: bool = False) -> Future:
        """Make ``ref`` resident; the future resolves to its ``Slot`` or raises a ``LoraserveError``."""
        fut: Future = Future()
        self._post(Load(ref, pin, fut))
        return fut

    def unload_adapter(self, ref: str, force: bool = False, deleted: bool = False) -> Future:
        """Empty ``ref``'s slot; the future resolves to the ``Slot`` it was, or raises NotFound /
        FailedPrecondition (used by requests and not ``force``). ``deleted``: the registry deleted it; no new
        request gets it, its copies are forgotten, running requests finish (``engine.residency.Unload``)."""
        fut: Future = Future()
        self._post(Unload(ref, force, fut, deleted))
        return fut

    def snapshot(self) -> EngineSnapshot:
        """The state after the engine thread's latest step (immutable; cheap to call)."""
        return self._snapshot

    # ----------------------------------------------------------------- engine thread
    def _post(self, command: object) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._drain_inbox():
                    self._publish()
                busy = self.scheduler.step()
                self._publish()
                if not busy and self._inbox.empty():
                    self._wake.wait(0.05)
                    self._wake.clear()
            except Exception:  # never let one bad step kill the worker
                log.exception("engine step failed; failing running requests")
                self.scheduler.fail_running(Failed(grpc.StatusCode.INTERNAL, "engine step failed"))
                self._publish()

    def _publish(self) -> None:
        """A new snapshot, then the events and future results it accounts for."""
        self._snapshot = self.scheduler.snapshot()
        self.scheduler.flush()
        events = self.scheduler.kv_events
        if events and self.kv_publisher is not None:
            self.kv_publisher.publish(events)
            events.clear()

    def _drain_inbox(self) -> int:
        handled = 0
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return handled
            self.scheduler.handle(command)
            handled += 1
