"""Adapter residency: loads in flight, prepared host arrays, the host tier, pins and the slot table.

One object on the engine thread, driven by typed commands (``Load``, ``Unload``, ``Prepared``) through
``handle``; an unknown command is a ``TypeError``. Fetching, validating and preparing host arrays runs on
loader threads (``spawn``), which post a ``Prepared`` back; the engine thread only writes the slot, so a
cold adapter delays its own requests and nobody else's. ``handle`` and ``place_pending`` return what the
scheduler must act on: ``Resident`` (wake waiting requests), ``LoadFailed`` (fail them), ``Evicted``
(fail the requests that were using the slot). Futures complete from ``outbox`` once the engine has
published the snapshot that shows their effect. No JAX here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from loraserve.adapters.errors import AdapterUnavailableError
from loraserve.adapters.mix_weights import concat_adapters
from loraserve.adapters.mixes import MixPart, is_mix, mix_ref, parse_mix, validate_mix
from loraserve.adapters.peft import LoraWeights, parse_adapter
from loraserve.adapters.sources import AdapterSource, Origin, verify_sha256
from loraserve.common.errors import FailedPrecondition, LoraserveError, NotFound
from loraserve.common.slots import SlotState
from loraserve.engine.config import EngineConfig
from loraserve.engine.runner import Runner
from loraserve.engine.slot_table import HostTier, NoFreeSlotError, Slot, SlotTable
from loraserve.models.config import ModelConfig

log = logging.getLogger("loraserve.engine.residency")
MAX_DELETED = 4096  # deleted versions a worker remembers (a version number is never reused)
MAX_RESOLVED = 8192  # refs remembered as resolved (distinct mixes are unbounded: their weights are free)


@dataclass(frozen=True)
class Load:
    """Make ``ref`` resident (pinned if ``pin``); ``future`` gets its ``Slot`` or a ``LoraserveError``."""

    ref: str
    pin: bool
    future: Future


@dataclass(frozen=True)
class Unload:
    """Empty the slot holding ``ref``; refused while requests use it unless ``force``.

    ``deleted`` (the registry deleted the version): from now on no new request gets it (nor a mix holding
    it), its host-tier copy and the source's copies (disk cache, metadata) are forgotten, and its slots are
    emptied as soon as no request uses them: requests already admitted finish on it.
    """

    ref: str
    force: bool
    future: Future
    deleted: bool = False


@dataclass(frozen=True)
class Prepared:
    """A loader thread's result for ``ref``: host values for a slot, or the error that stopped it."""

    ref: str
    key: str = ""
    sha256: str = ""
    rank: int = 0
    values: Any = None
    error: LoraserveError | None = None
    seconds: float = 0.0
    origin: Origin | None = None  # where the bytes came from (None: it failed)
    fetched_bytes: int = 0  # bytes read from outside the process (0 for a host-tier hit)


@dataclass(frozen=True)
class Resident:
    key: str


@dataclass(frozen=True)
class LoadFailed:
    ref: str
    error: LoraserveError


@dataclass(frozen=True)
class Evicted:
    index: int
    key: str


@dataclass(frozen=True)
class Drained:
    """A slot that was being drained (fair sharing) changed hands or stopped draining: the requests held
    back from ``key`` may ask for it again."""

    key: str


Outcome = Resident | LoadFailed | Evicted | Drained


class Residency:
    def __init__(
        self,
        runner: Runner,
        source: AdapterSource,
        model_config: ModelConfig,
        config: EngineConfig,
        post: Callable[[Prepared], None],
        spawn: Callable[[Callable[[str], None], str], Any],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.runner, self.source, self.model_config, self.config = runner, source, model_config, config
        self._post, self._spawn = post, spawn
        self.table = SlotTable(config.max_loras, clock)
        self.host_tier = HostTier(config.max_cpu_loras)
        self._loads: dict[str, list[tuple[Future, bool]]] = {}  # ref -> LoadAdapter callers
        self._pending: deque[Prepared] = deque()  # prepared, waiting for a free slot
        self._resolved: dict[str, str] = {}  # ref -> key, once a load succeeded
        # versions the registry deleted (newest last, at most MAX_DELETED): never served again by this worker
        self._deleted: dict[str, None] = {}
        self._inflight: set[str] = set()
        # refs wanted while MAX loads were in flight or prepared (each holds a slot's worth of host arrays):
        # started in order as those finish; a ref nobody waits for any more is dropped (abandon)
        self._queued: deque[str] = deque()
        self._abandoned: set[str] = set()  # in flight, but nobody waits for them now: discarded on arrival
        # fair sharing of slots: slot -> the adapter it holds, drained for a prepared load that finds every
        # slot referenced (no new request takes a reference on it; it changes hands when its last ends)
        self.draining: dict[int, str] = {}
        self.max_loads = max(2, config.max_loras)
        self.adapter_loads = 0
        self.outbox: list[Callable[[], None]] = []  # future completions, run after the next snapshot
        self.load_observer: Callable[[float], None] | None = None  # seconds per prepared adapter
        # (key, seconds, origin, bytes fetched) per prepared adapter: per-adapter accounting
        self.load_recorder: Callable[[str, float, str, int], None] | None = None

    # ----------------------------------------------------------------- engine thread
    def handle(self, command: Load | Unload | Prepared) -> list[Outcome]:
        match command:
            case Load(ref, pin, future):
                self._loads.setdefault(ref, []).append((future, pin))
                key = self._resolved.get(ref)
                slot = self.table.find(key) if key else None
                if slot is not None and slot.state == SlotState.LOADED:
                    self._settle(ref, key)
                    return []
                self.want(ref)
                return []
            case Unload(ref, force, future, deleted):
                if deleted:
                    return self._delete(ref, future)
                return self._unload(ref, force, future)
            case Prepared():
                return self._prepared(command)
            case _:
                raise TypeError(f"residency has no command {type(command).__name__}")

    def _later(self, future: Future, value: Any) -> None:
        """Complete ``future`` with ``value`` (an exception fails it) at the next flush."""

        def complete() -> None:
            if future.done():  # the caller gave up (cancelled)
                return
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

        self.outbox.append(complete)

    def acquire(self, ref: str) -> tuple[str, int] | None:
        """A reference on ``ref``'s slot as ``(key, slot)``, or None when it is not resident (or its slot is
        being drained: :meth:`is_draining`)."""
        if self.is_draining(ref):
            return None
        key = self._resolved.get(ref)
        slot = self.table.acquire(key) if key and not self._is_deleted(key) else None
        return None if slot is None else (key, slot)

    def is_draining(self, ref: str) -> bool:
        """Whether ``ref`` is resident in a slot being drained: its new requests wait for :class:`Drained`."""
        key = self._resolved.get(ref)
        return bool(key) and key in self.draining.values()

    def release(self, index: int) -> None:
        """Drop a request's reference; a slot of a deleted version is emptied with its last reference."""
        self.table.release(index)
        slot = self.table.slots()[index]
        if slot.refcount == 0 and slot.adapter and self._is_deleted(slot.adapter):
            self.runner.zero_slot(index)
            self.table.clear(index)
            log.info("emptied slot %d: %s was deleted and its last request finished", index, slot.adapter)

    def _is_deleted(self, key: str) -> bool:
        """Whether ``key`` (a version or a mix key) is, or holds, a version the registry deleted."""
        if not self._deleted:
            return False
        return key in self._deleted or (is_mix(key) and any(p.ref in self._deleted for p in parse_mix(key)))

    def want(self, ref: str) -> None:
        """Start one background load per ref, however many requests wait for it; at most ``max_loads`` are
        in flight or prepared and waiting for a slot at once (each holds a slot's worth of host arrays),
        later ones queue and start in order."""
        self._abandoned.discard(ref)
        if ref in self._inflight or ref in self._queued or any(p.ref == ref for p in self._pending):
            return
        self._queued.append(ref)
        self._start_loads()

    def abandon(self, ref: str) -> None:
        """No request waits for ``ref`` any more (cancelled, expired): unless a LoadAdapter call still wants
        it, forget its queued or prepared load (a load in flight is discarded when it arrives)."""
        if self._loads.get(ref):
            return
        if ref in self._queued:
            self._queued.remove(ref)
        self._pending = deque(p for p in self._pending if p.ref != ref)
        if ref in self._inflight:
            self._abandoned.add(ref)
        self._start_loads()

    def _start_loads(self) -> None:
        while self._queued and len(self._inflight) + len(self._pending) < self.max_loads:
            ref = self._queued.popleft()
            self._inflight.add(ref)
            self._spawn(self._prepare, ref)

    def place_pending(self) -> Iterator[Outcome]:
        """Write prepared adapters into slots (evicting LRU ones); those without a free slot wait.

        Lazy: the caller acts on each ``Resident`` before the next placement, so the requests waiting
        for an adapter take their references before another prepared adapter may evict it.
        """
        unplaced = 0
        for _ in range(len(self._pending)):
            p = self._pending.popleft()
            resident = self.table.find(p.key)
            if resident is None or resident.state != SlotState.LOADED:
                pin = any(pin for _, pin in self._loads.get(p.ref, []))
                try:
                    index, evicted = self.table.reserve(
                        p.key, sha256=p.sha256, rank=p.rank, pin=pin, prefer=frozenset(self.draining)
                    )
                except NoFreeSlotError:
                    self._pending.append(p)
                    unplaced += 1
                    continue
                if evicted:
                    log.info("evicted adapter %s from slot %d for %s", evicted, index, p.key)
                try:
                    self.runner.write_slot(index, p.values)
                except LoraserveError as exc:  # a multi-host runner checks DoRA's scales as it writes them
                    self.table.clear(index)  # the runner left it empty
                    self.host_tier.drop(p.key)
                    for future, _ in self._loads.pop(p.ref, []):
                        self._later(future, exc)
                    yield LoadFailed(p.ref, exc)
                    continue
                self.table.mark_loaded(index)
                self.adapter_loads += 1
            self._settle(p.ref, p.key)
            self._start_loads()
            yield Resident(p.key)
        yield from self._rebalance(unplaced)

    def _rebalance(self, unplaced: int) -> Iterator[Outcome]:
        """Fair sharing (``EngineConfig.fair_slots``): one slot drains for each prepared load that found every
        slot referenced, the one filled longest ago first (so the slots rotate over the adapters that want
        them and nobody waits for ever behind a steady stream for another); drains nobody needs any more
        stop, and a drained slot that changed hands is done. Either way its held-back requests are let go
        (:class:`Drained`)."""
        slots = self.table.slots()
        for index, key in list(self.draining.items()):
            if slots[index].adapter != key or slots[index].state != SlotState.LOADED:
                del self.draining[index]
                yield Drained(key)
        while len(self.draining) > unplaced:
            index = max(self.draining, key=lambda i: slots[i].loaded_seq)  # the newest drain stops first
            yield Drained(self.draining.pop(index))
        if not self.config.fair_slots:
            return
        candidates = sorted(
            (
                s
                for s in slots
                if s.state == SlotState.LOADED and not s.pinned and s.index not in self.draining
            ),
            key=lambda s: s.loaded_seq,
        )
        for slot in candidates[: max(0, unplaced - len(self.draining))]:
            log.info("draining slot %d (%s) for a waiting adapter", slot.index, slot.adapter)
            self.draining[slot.index] = slot.adapter

    def _prepared(self, p: Prepared) -> list[Outcome]:
        self._inflight.discard(p.ref)
        self._start_loads()
        if p.ref in self._abandoned and not self._loads.get(p.ref):  # nobody waits for it any more
            self._abandoned.discard(p.ref)
            return []
        self._abandoned.discard(p.ref)
        if p.error is None and self._is_deleted(p.key):  # deleted while it loaded
            self.host_tier.drop(p.key)
            p = Prepared(p.ref, error=NotFound(f"adapter {p.key} was deleted"))
        if p.error is not None:
            for future, _ in self._loads.pop(p.ref, []):
                self._later(future, p.error)
            return [LoadFailed(p.ref, p.error)]
        self._resolved[p.ref] = p.key
        if len(self._resolved) > MAX_RESOLVED:  # every distinct ref (mixes: any weights) adds one
            held = {slot.adapter for slot in self.table.slots()}
            for ref in [r for r, k in self._resolved.items() if k not in held][: len(self._resolved) // 4]:
                del self._resolved[ref]  # oldest first; a later request for it resolves again
        if self.load_observer is not None:
            self.load_observer(p.seconds)
        if self.load_recorder is not None:
            self.load_recorder(p.key, p.seconds, p.origin, p.fetched_bytes)
        slot = self.table.find(p.key)
        if slot is not None and slot.state == SlotState.LOADED:
            self._settle(p.ref, p.key)
            return [Resident(p.key)]
        self._pending.append(p)
        return []

    def _unload(self, ref: str, force: bool, future: Future) -> list[Outcome]:
        """Empty ``ref``'s slot. With ``force`` (the registry deleted it) also forget its host-tier copy and
        empty the slots of mixes it is a part of, so nothing deleted stays servable (the future then gets the
        first slot emptied; NotFound when no slot held it, its host-tier copy forgotten all the same)."""
        key = self._resolved.get(ref, ref)
        slot = self.table.find(key)
        mixes = [s for s in self.table.slots() if s.state == SlotState.LOADED and _is_part_of(key, s.adapter)]
        if force:
            self.host_tier.drop(key)
        else:
            mixes = []
        if slot is None or slot.state != SlotState.LOADED:
            slot, mixes = (mixes[0], mixes[1:]) if mixes else (None, [])
        if slot is None:
            self._later(future, NotFound(f"adapter {ref!r} is not loaded on this worker"))
            return []
        if slot.refcount and not force:
            self._later(future, FailedPrecondition(f"adapter {key} is used by {slot.refcount} request(s)"))
            return []
        outcomes: list[Outcome] = []
        for s in (slot, *mixes):
            self.runner.zero_slot(s.index)
            cleared = self.table.clear(s.index)
            if s is slot:
                self._later(future, cleared)
            outcomes.append(Evicted(s.index, s.adapter))
        return outcomes

    def _delete(self, ref: str, future: Future) -> list[Outcome]:
        """The registry deleted ``ref`` (a ``name@version``): refuse it (and mixes holding it) to every new
        request, forget every copy (host tier; the source's disk cache and metadata, on a loader thread),
        empty its idle slots now and its busy ones with their last request (:meth:`release`). The future gets
        the first slot that held it, or NotFound when none did (everything is forgotten all the same)."""
        key = self._resolved.get(ref, ref)
        self._deleted[key] = None
        while len(self._deleted) > MAX_DELETED:
            del self._deleted[next(iter(self._deleted))]
        self.host_tier.drop(key)
        forget = getattr(self.source, "forget", None)
        if forget is not None:
            self._spawn(forget, key)
        for r in [r for r, k in self._resolved.items() if self._is_deleted(k)]:
            del self._resolved[r]  # the next request for r resolves again (the registry: NOT_FOUND)
        held = [s for s in self.table.slots() if s.adapter and self._is_deleted(s.adapter)]
        outcomes: list[Outcome] = []
        for s in held:
            if s.refcount == 0 and s.state == SlotState.LOADED:
                self.runner.zero_slot(s.index)
                self.table.clear(s.index)
                outcomes.append(Evicted(s.index, s.adapter))
        self._later(future, held[0] if held else NotFound(f"adapter {ref!r} is not loaded on this worker"))
        return outcomes

    def _settle(self, ref: str, key: str) -> None:
        """Resolve the LoadAdapter futures of ``ref`` (pinning first when any asked)."""
        callers = self._loads.pop(ref, [])
        slot = self.table.find(key)
        if slot is not None and any(pin for _, pin in callers):
            self.table.set_pinned(slot.index, True)
        result: Slot | None = self.table.find(key)
        for future, _ in callers:
            self._later(future, result)

    # ----------------------------------------------------------------- loader threads
    def _prepare(self, ref: str) -> None:
        """Resolve, fetch (or take from the host tier), validate and prepare host values; post the result.

        A mix ref (``adapters.mixes``) resolves and loads each part the same way (each kept in the host
        tier), then prepares their concatenation: one slot's values, under the mix key of resolved versions.
        """
        started = time.perf_counter()
        try:
            if is_mix(ref):
                key, weights, values, origin, fetched_bytes = self._prepare_mix(ref)
            else:
                key = self.source.resolve(ref)
                weights, values, origin, fetched_bytes = self._load(key)
            result = Prepared(
                ref,
                key,
                weights.sha256,
                weights.rank,
                values,
                seconds=time.perf_counter() - started,
                origin=origin,
                fetched_bytes=fetched_bytes,
            )
        except LoraserveError as exc:  # adapter errors included: each carries its status
            result = Prepared(ref, error=exc)
        except Exception as exc:  # storage errors and the like
            log.exception("loading adapter %s failed", ref)
            result = Prepared(ref, error=AdapterUnavailableError(f"loading adapter {ref!r} failed: {exc}"))
        self._post(result)

    def _load(self, key: str) -> tuple[LoraWeights, Any, Origin, int]:
        """``key``'s weights and slot values, from the host tier or fetched, checked and prepared (then kept
        in the host tier); with where the bytes came from and how many were read from the object store."""
        cached = self.host_tier.get(key)
        if cached is not None:
            return (*cached, Origin.HOST, 0)
        fetched = self.source.fetch(key)
        verify_sha256(fetched)
        cfg = self.model_config
        weights = parse_adapter(
            fetched.config_bytes,
            fetched.weights_bytes,
            module_shapes=cfg.adapter_shapes(),
            num_layers=cfg.num_layers,
            max_rank=self.config.max_lora_rank,
        )
        values = self.runner.prepare(weights)
        self.host_tier.put(key, (weights, values))
        fetched_bytes = len(fetched.weights_bytes) if fetched.origin is Origin.STORE else 0
        return weights, values, fetched.origin, fetched_bytes

    def _prepare_mix(self, ref: str) -> tuple[str, LoraWeights, Any, Origin, int]:
        """A mix ref -> (mix key, the parts' concatenation, its slot values, origin, bytes fetched): every
        part resolved and loaded at once; the origin is the slowest part's."""
        parts = parse_mix(ref)
        validate_mix(parts, self.config.max_mix)
        loaded = []
        origins: list[Origin] = []
        fetched_bytes = 0
        for part in parts:
            key = self.source.resolve(part.ref)
            weights, _, origin, nbytes = self._load(key)
            loaded.append((key, weights, part.weight))
            origins.append(origin)
            fetched_bytes += nbytes
        weights = concat_adapters(loaded, self.config.max_lora_rank)
        key = mix_ref([MixPart(k, w) for k, _, w in loaded])
        origin = max(origins, key=lambda o: o.cost)
        return key, weights, self.runner.prepare(weights), origin, fetched_bytes


def _is_part_of(key: str, adapter: str) -> bool:
    """Whether the slot key ``adapter`` is a mix with ``key`` among its parts."""
    return is_mix(adapter) and any(p.ref == key for p in parse_mix(adapter))
