"""The engine: one thread that admits, prefills, inserts and decodes every request (JetStream style).

Other threads talk to it only through ``submit``/``cancel``/``load_adapter``/``unload_adapter``, which
post commands to its inbox. Adapter bytes are fetched, validated and turned into host arrays on a
loader pool; the engine thread only does the (jitted, donated, never-recompiling) slot write between
two decode steps, so a cold adapter delays its own requests and nobody else's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from loraserve import kernels
from loraserve.adapters.errors import AdapterError, AdapterUnavailableError
from loraserve.adapters.peft import parse_adapter
from loraserve.adapters.refs import split_ref
from loraserve.adapters.sources import AdapterSource, LocalAdapterSource, verify_sha256
from loraserve.worker import model as M
from loraserve.worker.checkpoint import Checkpoint
from loraserve.worker.config import EngineConfig
from loraserve.worker.requests import (
    EngineRequest,
    Failed,
    Finished,
    RequestError,
    Started,
    Token,
    validate_prompt,
)
from loraserve.worker.sampling import SamplingArrays, sample
from loraserve.worker.slots import (
    HostTier,
    NoFreeSlotError,
    Slot,
    SlotPools,
    SlotState,
    SlotTable,
    SlotValues,
    slot_arrays,
)

log = logging.getLogger("loraserve.worker.engine")


@dataclass
class _Prepared:
    ref: str
    key: str
    sha256: str = ""
    rank: int = 0
    arrays: SlotValues | None = None
    error: AdapterError | None = None


def _prefill_sample(cfg, backend, params, pools, tokens, length, slot, row, cache, inv_freq, samp):
    logits, cache = M.prefill(cfg, params, pools, tokens, length, slot, row, cache, inv_freq, backend)
    token = sample(logits[None], *samp)[0]  # samp arrays are [1]
    return token, cache


def _decode_sample(cfg, backend, params, pools, tokens, positions, plan, cache, inv_freq, samp):
    logits, cache = M.decode(cfg, params, pools, tokens, positions, plan, cache, inv_freq, backend)
    return sample(logits, *samp), cache


def enable_compilation_cache(path: str) -> None:
    """Keep every compiled program in ``path`` (JAX's persistent cache), however quick its compile.

    A worker restarted with the same model and shapes then warms up from disk: 18 s -> 3 s for the
    test model's warm-up (prefill buckets and every decode variant). Call before the first compile.
    """
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class Engine:
    """A continuously batching generation engine over one base model and ``max_loras`` adapter slots."""

    def __init__(
        self, checkpoint: Checkpoint, config: EngineConfig, source: AdapterSource | None = None
    ) -> None:
        self.checkpoint, self.config = checkpoint, config
        self.model_config = cfg = checkpoint.config
        self.params = checkpoint.params
        self.source: AdapterSource = source or LocalAdapterSource()
        dtype = jnp.dtype(config.dtype)
        self.backend = backend = kernels.resolve_backend(config.kernel_backend)
        log.info(
            "multi-LoRA kernels: %s (%s), slot pools %s", backend, config.kernel_backend, config.pool_dtype
        )
        self.table = SlotTable(config.max_loras)
        pool_dtype = jnp.dtype(config.pool_dtype)
        self.pools = SlotPools(cfg, config.max_loras, config.max_lora_rank, pool_dtype, backend)
        self.host_tier = HostTier(config.max_cpu_loras)
        self.cache = M.init_cache(cfg, config.max_batch_size, config.max_seq_len, dtype)
        self.inv_freq = jnp.asarray(cfg.inv_freq(), jnp.float32)
        self.eos_ids = frozenset(cfg.eos_token_ids)
        self.buckets = config.prefill_buckets()
        self._prefill = jax.jit(partial(_prefill_sample, cfg, backend), donate_argnums=(6,))
        self._decode = jax.jit(partial(_decode_sample, cfg, backend), donate_argnums=(5,))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: deque[EngineRequest] = deque()  # adapter not resident yet
        self._ready: deque[EngineRequest] = deque()  # holds a slot reference, waits for a decode row
        self._rows: list[EngineRequest | None] = [None] * config.max_batch_size
        self._loads: dict[str, list[tuple[Future, bool]]] = {}  # ref -> futures of LoadAdapter callers
        self._pending: deque[tuple[_Prepared, bool]] = deque()
        self._resolved: dict[str, str] = {}
        self._inflight: set[str] = set()
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="adapter-loader")
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.counters = {"adapter_loads": 0, "tokens_out": 0, "requests_done": 0}
        self.load_observer: Callable[[float], None] | None = None  # metrics hook: seconds per adapter load
        self._n_waiting = 0  # submitted, not yet running (guarded by _count_lock)
        self._count_lock = threading.Lock()

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
        self.ready.clear()

    def submit(self, req: EngineRequest) -> None:
        """Queue a request; raises RequestError (INVALID_ARGUMENT / RESOURCE_EXHAUSTED) at once."""
        cfg = self.model_config
        validate_prompt(req.prompt, cfg.vocab_size, self.config.max_seq_len)
        req.sampling.validate(cfg.vocab_size)
        if req.adapter:
            try:
                split_ref(req.adapter)
            except AdapterError as exc:
                raise RequestError(exc.code, str(exc)) from exc
        room = self.config.max_seq_len - len(req.prompt)
        req.max_new_tokens = min(req.sampling.max_tokens or self.config.default_max_tokens, room)
        req.seed = req.sampling.resolved_seed()
        with self._count_lock:
            if self._n_waiting >= self.config.max_waiting:
                raise RequestError("RESOURCE_EXHAUSTED", f"queue is full ({self.config.max_waiting} waiting)")
            self._n_waiting += 1
        self._post(("submit", req))

    def cancel(self, request_id: str) -> None:
        self._post(("cancel", request_id))

    def load_adapter(self, ref: str, pin: bool = False) -> Future:
        """Make ``ref`` resident; the future resolves to its Slot or raises AdapterError."""
        fut: Future = Future()
        self._post(("load", ref, pin, fut))
        return fut

    def unload_adapter(self, ref: str, force: bool = False) -> Future:
        fut: Future = Future()
        self._post(("unload", ref, force, fut))
        return fut

    def _dequeued(self) -> None:
        with self._count_lock:
            self._n_waiting -= 1

    def slots(self) -> list[Slot]:
        return self.table.snapshot()

    def load(self) -> dict[str, int]:
        running = sum(r is not None for r in self._rows)
        return {"running": running, "waiting": self._n_waiting, "free_slots": self.table.free_count()}

    # ----------------------------------------------------------------- warm-up
    def warmup(self) -> None:
        """Compile every bucketed shape once so that serving never compiles."""
        samp = SamplingArrays.empty(1).as_tuple()
        for bucket in self.buckets:
            tokens = jnp.zeros((bucket,), jnp.int32)
            _, self.cache = self._prefill(
                self.params,
                self.pools.pools,
                tokens,
                jnp.int32(1),
                jnp.int32(0),
                jnp.int32(0),
                self.cache,
                self.inv_freq,
                samp,
            )
        b = self.config.max_batch_size
        zeros = np.zeros(b, np.int32)
        # one decode compilation per plan variant of the LoRA backend (backend.plan picks one per step)
        for plan in self.backend.warmup_plans(b, self.config.max_loras):
            out, self.cache = self._decode(
                self.params,
                self.pools.pools,
                zeros,
                zeros,
                plan,
                self.cache,
                self.inv_freq,
                SamplingArrays.empty(b).as_tuple(),
            )
        self.pools.zero(0)
        jax.block_until_ready(out)

    # ----------------------------------------------------------------- engine thread
    def _post(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox()
                self._place_pending()
                self._admit()
                if any(r is not None for r in self._rows):
                    self._decode_step()
                elif self._inbox.empty():
                    self._wake.wait(0.05)
                    self._wake.clear()
            except Exception:  # never let one bad step kill the worker
                log.exception("engine step failed; failing running requests")
                for i, req in enumerate(self._rows):
                    if req is not None:
                        self._finish(i, Failed("INTERNAL", "engine step failed"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "submit":
                self._on_submit(command[1])
            elif kind == "cancel":
                self._on_cancel(command[1])
            elif kind == "load":
                self._on_load(*command[1:])
            elif kind == "unload":
                self._on_unload(*command[1:])
            elif kind == "prepared":
                self._on_prepared(command[1], command[2])

    def _on_submit(self, req: EngineRequest) -> None:
        if not req.adapter:
            self._ready.append(req)
            return
        key = self._resolved.get(req.adapter)
        slot = self.table.acquire(key) if key else None
        if slot is not None:
            req.key, req.slot = key, slot
            self._ready.append(req)
            return
        self._waiting.append(req)
        self._ensure_load(req.adapter, pin=False)

    def _on_cancel(self, request_id: str) -> None:
        for i, req in enumerate(self._rows):
            if req is not None and req.request_id == request_id:
                self._finish(i, Failed("CANCELLED", "cancelled by the client"))
                return
        for pool in (self._ready, self._waiting):
            for req in list(pool):
                if req.request_id == request_id:
                    pool.remove(req)
                    self._dequeued()
                    if req.slot >= 0:
                        self.table.release(req.slot)
                    req.emit(Failed("CANCELLED", "cancelled by the client"))
                    return

    def _on_load(self, ref: str, pin: bool, fut: Future) -> None:
        self._loads.setdefault(ref, []).append((fut, pin))
        key = self._resolved.get(ref)
        slot = self.table.find(key) if key else None
        if slot is not None and slot.state == SlotState.LOADED:
            self._settle_loads(ref, key)
            return
        self._ensure_load(ref, pin)

    def _on_unload(self, ref: str, force: bool, fut: Future) -> None:
        key = self._resolved.get(ref, ref)
        slot = self.table.find(key)
        if slot is None or slot.state != SlotState.LOADED:
            fut.set_exception(RequestError("NOT_FOUND", f"adapter {ref!r} is not loaded on this worker"))
            return
        if slot.refcount and not force:
            fut.set_exception(
                RequestError("FAILED_PRECONDITION", f"adapter {key} is used by {slot.refcount} request(s)")
            )
            return
        for i, req in enumerate(self._rows):
            if req is not None and req.slot == slot.index:
                self._finish(i, Failed("UNAVAILABLE", f"adapter {key} was unloaded"))
        for req in [r for r in self._ready if r.slot == slot.index]:
            self._ready.remove(req)
            self._dequeued()
            self.table.release(req.slot)
            req.emit(Failed("UNAVAILABLE", f"adapter {key} was unloaded"))
        self.pools.zero(slot.index)
        fut.set_result(self.table.clear(slot.index))

    def _ensure_load(self, ref: str, pin: bool) -> None:
        """Start one background load per ref, however many requests wait for it."""
        if ref not in self._inflight:
            self._inflight.add(ref)
            self._loader.submit(self._prepare, ref)

    def _prepare(self, ref: str) -> None:
        """Loader thread: resolve, fetch (or take from the host tier), validate, build host arrays."""
        started = time.perf_counter()
        try:
            key = self.source.resolve(ref)
            cached = self.host_tier.get(key)
            if cached is not None:
                weights, arrays = cached
            else:
                fetched = self.source.fetch(key)
                verify_sha256(fetched)
                cfg = self.model_config
                weights = parse_adapter(
                    fetched.config_bytes,
                    fetched.weights_bytes,
                    module_shapes=cfg.module_shapes(),
                    num_layers=cfg.num_layers,
                    max_rank=self.config.max_lora_rank,
                )
                arrays = slot_arrays(cfg, weights, self.config.max_lora_rank)
                self.host_tier.put(key, (weights, arrays))
            prepared = _Prepared(ref, key, weights.sha256, weights.rank, arrays)
        except AdapterError as exc:
            prepared = _Prepared(ref, "", error=exc)
        except Exception as exc:  # storage errors and the like
            log.exception("loading adapter %s failed", ref)
            prepared = _Prepared(
                ref, "", error=AdapterUnavailableError(f"loading adapter {ref!r} failed: {exc}")
            )
        self._post(("prepared", prepared, time.perf_counter() - started))

    def _on_prepared(self, prepared: _Prepared, seconds: float) -> None:
        self._inflight.discard(prepared.ref)
        if prepared.error is not None:
            err = prepared.error
            for req in [r for r in self._waiting if r.adapter == prepared.ref]:
                self._waiting.remove(req)
                self._dequeued()
                req.emit(Failed(err.code, str(err)))
            for fut, _ in self._loads.pop(prepared.ref, []):
                fut.set_exception(err)
            return
        self._resolved[prepared.ref] = prepared.key
        if self.load_observer is not None:
            self.load_observer(seconds)
        pin = any(p for _, p in self._loads.get(prepared.ref, []))
        slot = self.table.find(prepared.key)
        if slot is not None and slot.state == SlotState.LOADED:
            if pin:
                self.table.set_pinned(slot.index, True)
            self._after_resident(prepared.ref, prepared.key)
            return
        self._pending.append((prepared, pin))

    def _place_pending(self) -> None:
        for _ in range(len(self._pending)):
            prepared, pin = self._pending.popleft()
            try:
                index, evicted = self.table.reserve(
                    prepared.key, sha256=prepared.sha256, rank=prepared.rank, pin=pin
                )
            except NoFreeSlotError:
                self._pending.append((prepared, pin))
                continue
            if evicted:
                log.info("evicted adapter %s from slot %d for %s", evicted, index, prepared.key)
            self.pools.write(index, prepared.arrays)
            self.table.mark_loaded(index)
            self.counters["adapter_loads"] += 1
            self._after_resident(prepared.ref, prepared.key)

    def _after_resident(self, ref: str, key: str) -> None:
        for req in [r for r in self._waiting if self._resolved.get(r.adapter) == key]:
            slot = self.table.acquire(key)
            if slot is None:
                break
            self._waiting.remove(req)
            req.key, req.slot = key, slot
            self._ready.append(req)
        self._settle_loads(ref, key)

    def _settle_loads(self, ref: str, key: str) -> None:
        slot = self.table.find(key)
        for fut, pin in self._loads.pop(ref, []):
            if pin and slot is not None:
                self.table.set_pinned(slot.index, True)
            fut.set_result(self.table.find(key))

    # ----------------------------------------------------------------- prefill / decode
    def _admit(self) -> None:
        admitted = 0
        while self._ready and admitted < self.config.prefill_per_step:
            try:
                row = self._rows.index(None)
            except ValueError:
                return
            req = self._ready.popleft()
            self._dequeued()
            self._prefill_into(req, row)
            admitted += 1

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _sampling_row(self, req: EngineRequest, arrays: SamplingArrays, i: int) -> None:
        s = req.sampling
        arrays.temperature[i], arrays.top_k[i], arrays.top_p[i] = s.temperature, s.top_k, s.top_p
        arrays.seed_lo[i], arrays.seed_hi[i] = req.seed & 0xFFFFFFFF, req.seed >> 32
        arrays.step[i] = len(req.generated)

    def _prefill_into(self, req: EngineRequest, row: int) -> None:
        n = len(req.prompt)
        tokens = np.zeros(self._bucket(n), np.int32)
        tokens[:n] = req.prompt
        samp = SamplingArrays.empty(1)
        self._sampling_row(req, samp, 0)
        token, self.cache = self._prefill(
            self.params,
            self.pools.pools,
            tokens,
            np.int32(n),
            np.int32(req.slot),
            np.int32(row),
            self.cache,
            self.inv_freq,
            samp.as_tuple(),
        )
        req.row = row
        self._rows[row] = req
        req.emit(Started(req.key))
        self._accept(row, int(token))

    def _decode_step(self) -> None:
        b = self.config.max_batch_size
        tokens, positions, slots = np.zeros(b, np.int32), np.zeros(b, np.int32), np.full(b, -1, np.int32)
        samp = SamplingArrays.empty(b)
        for i, req in enumerate(self._rows):
            if req is None:
                continue
            tokens[i] = req.generated[-1]
            positions[i] = len(req.prompt) + len(req.generated) - 1
            slots[i] = req.slot
            self._sampling_row(req, samp, i)
        out, self.cache = self._decode(
            self.params,
            self.pools.pools,
            tokens,
            positions,
            self.backend.plan(slots, self.config.max_loras),
            self.cache,
            self.inv_freq,
            samp.as_tuple(),
        )
        out = np.asarray(out)
        for i, req in enumerate(self._rows):
            if req is not None:
                self._accept(i, int(out[i]))

    def _accept(self, row: int, token: int) -> None:
        req = self._rows[row]
        assert req is not None
        req.generated.append(token)
        self.counters["tokens_out"] += 1
        s, n = req.sampling, len(req.generated)
        reason = ""
        if token in self.eos_ids and not s.ignore_eos:
            reason = "eos"
        elif token in s.stop_token_ids:
            reason = "stop"
        elif n >= req.max_new_tokens:
            reason = "length"
        if reason:  # the last token travels with the finish, in one message
            self._finish(row, Finished(reason, len(req.prompt), n, token_id=token))
        else:
            req.emit(Token(token))

    def _finish(self, row: int, event: Finished | Failed) -> None:
        req = self._rows[row]
        if req is None:
            return
        self._rows[row] = None
        if req.slot >= 0:
            self.table.release(req.slot)
        self.counters["requests_done"] += 1
        req.emit(event)
