"""The host side of the engine: queues, decode rows, KV pages, admission, preemption, cancellation,
deadlines, finishes.

Requests live in one of three places: ``waiting`` (their adapter is not resident yet), ``ready`` (they
hold a slot reference and wait for a free decode row and enough KV pages) or ``rows`` (decoding; each
row's pages are in ``pages`` and its page table in ``tables``, idle rows' tables all 0). ``handle``
applies one command (``Submit``, ``Cancel``, or a residency command); ``step`` places prepared adapters,
expires deadlines, admits up to ``prefill_per_step`` prompts and runs one decode step on the ``Runner``.

KV pages (``worker.kv_cache``): the head of ``ready`` is admitted only when the pages of its prompt that
the prefix cache does not hold, plus the page of its first decode token, can be had (free or reclaimable)
besides the pages the running rows take at the next step; otherwise admission stops there (FIFO, nobody
jumps ahead). Before each decode step a row whose next
position starts a page gets one; when none is left the newest running request is preempted: its pages are
released (full computed pages stay cached), it keeps its slot reference and generated tokens and goes back
to the FRONT of ``ready``; its resume is a prefill of prompt + generated from the cached hits on, which
samples the next new token, so nothing streamed is repeated or lost.
Events and future results wait in ``outbox`` until ``flush``: the engine publishes the snapshot first, so
whoever sees an event also sees its effect in ``engine.snapshot()``. Everything here runs on the engine
thread, except ``accept`` (callers' threads). No JAX here.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import numpy as np

from loraserve.adapters.mixes import is_mix, parse_mix, validate_mix
from loraserve.adapters.refs import parse_ref
from loraserve.common.errors import ResourceExhausted
from loraserve.common.finish_reasons import FinishReason
from loraserve.worker.config import EngineConfig
from loraserve.worker.kv_cache import BASE_KEY, KVCache, SeqPages
from loraserve.worker.model_config import ModelConfig
from loraserve.worker.requests import (
    EngineRequest,
    Failed,
    Finished,
    SamplingRow,
    Started,
    Token,
    validate_prompt,
)
from loraserve.worker.residency import (
    Evicted,
    Load,
    LoadFailed,
    Outcome,
    Prepared,
    Residency,
    Resident,
    Unload,
)
from loraserve.worker.runner import PrefillInput, Runner, StepOutput
from loraserve.worker.snapshot import EngineSnapshot

NO_ROOM = Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "the request needs more KV pages than the pool holds")
CANCELLED = Failed(grpc.StatusCode.CANCELLED, "cancelled by the client")
DEADLINE = Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")


@dataclass(frozen=True)
class Submit:
    request: EngineRequest


@dataclass(frozen=True)
class Cancel:
    request_id: str


class Scheduler:
    def __init__(
        self,
        runner: Runner,
        residency: Residency,
        model_config: ModelConfig,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner, self.residency, self.model_config, self.config = runner, residency, model_config, config
        self.clock = clock
        self.eos_ids = frozenset(model_config.eos_token_ids)
        self.waiting: deque[EngineRequest] = deque()
        self.ready: deque[EngineRequest] = deque()
        self.rows: list[EngineRequest | None] = [None] * config.max_batch_size
        if runner.page_size != config.kv_page_size:
            raise ValueError(
                f"runner pages hold {runner.page_size} tokens, the config says {config.kv_page_size}"
            )
        self.kv = KVCache(runner.num_pages, runner.page_size, config.enable_prefix_caching)
        self.pages: list[SeqPages | None] = [None] * config.max_batch_size
        self.tables = np.zeros((config.max_batch_size, config.pages_per_row), np.int32)
        self._admitted = [0] * config.max_batch_size  # admission order of each row's request (newest = max)
        # per row: None, or how many tokens of its sequence are computed while its prompt is chunked
        self.prefilled: list[int | None] = [None] * config.max_batch_size
        self._admissions = 0
        self.steps = self.tokens_out = self.requests_done = self.preemptions = 0
        self.outbox: list[Callable[[], None]] = []  # events, delivered by flush() after the snapshot
        self._queued = 0  # accepted, not yet in a row nor ended (guarded by _lock: accept runs anywhere)
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- any thread
    def accept(self, req: EngineRequest) -> Submit:
        """Validate and count ``req`` against ``max_waiting``; raises InvalidArgument / ResourceExhausted."""
        cfg = self.model_config
        validate_prompt(req.prompt, cfg.vocab_size, self.config.max_seq_len)
        req.sampling.validate(cfg.vocab_size)
        if req.adapter and is_mix(req.adapter):  # a weighted mix (adapters.mixes): its parts and weights
            validate_mix(parse_mix(req.adapter), self.config.max_mix)
        elif req.adapter:
            parse_ref(req.adapter)  # an AdapterError (INVALID_ARGUMENT) for a malformed ref
        room = self.config.max_seq_len - len(req.prompt)
        req.max_new_tokens = min(req.sampling.max_tokens or self.config.default_max_tokens, room)
        req.seed = req.sampling.resolved_seed()
        with self._lock:
            if self._queued >= self.config.max_waiting:
                raise ResourceExhausted(f"queue is full ({self.config.max_waiting} waiting)")
            self._queued += 1
        return Submit(req)

    @property
    def queued(self) -> int:
        return self._queued

    # ----------------------------------------------------------------- engine thread
    def handle(self, command: Submit | Cancel | Load | Unload | Prepared) -> None:
        match command:
            case Submit(req):
                self._submit(req)
            case Cancel(request_id):
                self._cancel(request_id)
            case Load() | Unload() | Prepared():
                self._apply(self.residency.handle(command))
            case _:
                raise TypeError(f"the scheduler has no command {type(command).__name__}")

    def step(self) -> bool:
        """One round; returns whether a prefill or a decode step ran (False = idle)."""
        self._apply(self.residency.place_pending())
        self._expire()
        prefilled = self._admit()
        return self._decode() or prefilled

    def fail_running(self, event: Failed) -> None:
        for i in range(len(self.rows)):
            self._finish(i, event)

    def flush(self) -> None:
        """Deliver the events and future results of the last commands/step (after publishing a snapshot)."""
        calls, self.outbox, self.residency.outbox = self.residency.outbox + self.outbox, [], []
        for call in calls:
            call()

    def _emit(self, req: EngineRequest, event) -> None:
        self.outbox.append(lambda: req.emit(event))

    def snapshot(self) -> EngineSnapshot:
        rows = [r for r in self.rows if r is not None]
        res = self.residency
        return EngineSnapshot(
            step=self.steps,
            slots=res.table.slots(),
            running=len(rows),
            waiting=self._queued,
            running_adapters=tuple(sorted({r.key for r in rows if r.key})),
            waiting_adapters=tuple(sorted({r.adapter for r in (*self.waiting, *self.ready) if r.adapter})),
            adapter_loads=res.adapter_loads,
            tokens_out=self.tokens_out,
            requests_done=self.requests_done,
            host_tier=res.host_tier.keys(),
            max_batch_size=self.config.max_batch_size,
            kv_page_size=self.kv.page_size,
            kv_pages_total=self.kv.total,
            kv_pages_used=self.kv.used,
            kv_pages_cached=self.kv.cached,
            prefix_hit_tokens=self.kv.hit_tokens,
            prefix_query_tokens=self.kv.query_tokens,
            preemptions=self.preemptions,
        )

    # ----------------------------------------------------------------- commands
    def _submit(self, req: EngineRequest) -> None:
        if not req.adapter:
            self.ready.append(req)
            return
        held = self.residency.acquire(req.adapter)
        if held is not None:
            req.key, req.slot = held
            self.ready.append(req)
            return
        self.waiting.append(req)
        self.residency.want(req.adapter)

    def _cancel(self, request_id: str) -> None:
        for i, req in enumerate(self.rows):
            if req is not None and req.request_id == request_id:
                self._finish(i, CANCELLED)
                return
        self._drop(lambda r: r.request_id == request_id, CANCELLED)

    def _apply(self, outcomes: Iterable[Outcome]) -> None:
        for outcome in outcomes:
            match outcome:
                case Resident():
                    for req in list(self.waiting):
                        held = self.residency.acquire(req.adapter)
                        if held is not None:
                            self.waiting.remove(req)
                            req.key, req.slot = held
                            self.ready.append(req)
                case LoadFailed(ref, err):
                    failed = Failed(err.code, err.message)
                    self._drop(lambda r, ref=ref: r.adapter == ref, failed, (self.waiting,))
                case Evicted(index, key):
                    gone = Failed(grpc.StatusCode.UNAVAILABLE, f"adapter {key} was unloaded")
                    for i, req in enumerate(self.rows):
                        if req is not None and req.slot == index:
                            req.slot = -1  # the slot is already cleared: nothing to release
                            self._finish(i, gone)
                    holders = [r for r in self.ready if r.slot == index]
                    for req in holders:
                        req.slot = -1
                    self._drop(lambda r, holders=holders: r in holders, gone, (self.ready,))
                case _:
                    raise TypeError(f"the scheduler has no outcome {type(outcome).__name__}")

    def _drop(
        self, match: Callable[[EngineRequest], bool], event: Failed, queues: tuple[deque, ...] = ()
    ) -> None:
        """End the queued (not running) requests that ``match`` selects with ``event``."""
        for queue in queues or (self.ready, self.waiting):
            for req in [r for r in queue if match(r)]:
                queue.remove(req)
                self._dequeued()
                self._release_slot(req)
                self._emit(req, event)
                if queue is self.waiting and all(r.adapter != req.adapter for r in self.waiting):
                    self.residency.abandon(req.adapter)  # its last waiter: the load is not needed

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _expire(self) -> None:
        now = self.clock()
        for i, req in enumerate(self.rows):
            if req is not None and req.deadline is not None and req.deadline <= now:
                self._finish(i, DEADLINE)
        self._drop(lambda r: r.deadline is not None and r.deadline <= now, DEADLINE)

    # ----------------------------------------------------------------- prefill / decode
    def _admit(self) -> bool:
        """This step's prefill; returns whether one ran.

        First the next chunk of every row still prefilling (oldest first), then ready requests in FIFO
        order, up to ``prefill_per_step`` of them, while rows, pages and the step's token budget last. The
        budget is ``prefill_chunk`` tokens (0 = none: every prompt whole): a longer prompt is computed
        a chunk per step, each step's decode runs in between, so a newcomer's prompt never stalls the
        running rows for longer than one chunk. All of it goes to the runner as one packed prefill; a
        row's last chunk samples its first token (an earlier chunk's sample is dropped)."""
        budget = self.config.prefill_chunk or None
        parts: list[tuple[int, EngineRequest, SeqPages, bool]] = []
        batch: list[PrefillInput] = []

        def take(row: int, req: EngineRequest, pages: SeqPages, seq: list[int], start: int) -> None:
            nonlocal budget
            end = len(seq) if budget is None else min(len(seq), start + budget)
            if budget is not None:
                budget -= end - start
            table = self.tables[row].copy()  # the runner may hold on to it (a zero-copy device array)
            batch.append(PrefillInput(seq[start:end], start, req.slot, table, SamplingRow.of(req)))
            final = end == len(seq)
            self.prefilled[row] = None if final else end
            parts.append((row, req, pages, final))
            # registered now, computed by the prefill below: a later prompt of this same batch may share
            # them (the runner writes every sequence's keys/values before any of them attends)
            self.kv.register(pages, seq, end)

        for row in sorted(self._prefilling(), key=self._admitted.__getitem__):
            if budget == 0:
                break
            req, pages = self.rows[row], self.pages[row]
            assert req is not None and pages is not None
            take(row, req, pages, req.prompt + req.generated, self.prefilled[row])
        admitted = 0
        while self.ready and admitted < self.config.prefill_per_step and budget != 0:
            try:
                row = self.rows.index(None)
            except ValueError:
                break
            req = self.ready[0]
            seq = req.prompt + req.generated  # prompt + what was streamed before a preemption
            key = self._adapter_key(req)
            lookup = self.kv.lookup(key, seq, reserve=1)  # + the page of the first decode token
            if lookup.hits + lookup.new_pages > self.kv.total:  # config keeps one context in the pool
                self.ready.popleft()
                self._dequeued()
                self._release_slot(req)
                self._emit(req, NO_ROOM)
                continue
            if not self.kv.can_take(lookup, spare=self._pages_due()):
                break  # the head waits for pages; nobody behind it goes first
            self.ready.popleft()
            self._dequeued()
            pages = self.kv.admit(key, seq, lookup)
            self._place(row, req, pages)
            take(row, req, pages, seq, lookup.hits * self.kv.page_size)
            admitted += 1
        if not batch:
            return False
        try:
            out = self.runner.prefill(batch)
        except BaseException:
            for _, _, pages, _ in parts:
                self.kv.forget(pages)
            raise
        assert len(out.tokens) == len(parts), (len(out.tokens), len(parts))
        for i, (row, req, _, final) in enumerate(parts):
            if not final:
                continue
            if not req.generated:
                self._emit(req, Started(req.key))
            self._accept_token(row, out, i)
        return True

    def _prefilling(self) -> list[int]:
        """Rows whose prompt is still being computed, a chunk per step (they take no decode step yet)."""
        return [i for i, done in enumerate(self.prefilled) if done is not None]

    def _adapter_key(self, req: EngineRequest) -> str:
        """The prefix cache's key for ``req``'s pages: its slot's adapter content sha256, or the base's."""
        if req.slot < 0:
            return BASE_KEY
        sha = self.residency.table.slots()[req.slot].sha256
        assert sha, f"slot {req.slot} holds no adapter content"
        return sha

    def _place(self, row: int, req: EngineRequest, pages: SeqPages) -> None:
        req.row = row
        self.rows[row] = req
        self.pages[row] = pages
        self._sync_table(row)
        self._admissions += 1
        self._admitted[row] = self._admissions

    def _sync_table(self, row: int) -> None:
        pages = self.pages[row]
        self.tables[row] = 0
        if pages is not None:
            self.tables[row, : len(pages.pages)] = pages.pages

    def _release_pages(self, row: int) -> None:
        pages = self.pages[row]
        if pages is not None:
            self.kv.release(pages)
        self.pages[row] = None
        self.tables[row] = 0

    def _release_slot(self, req: EngineRequest) -> None:
        if req.slot >= 0:
            self.residency.release(req.slot)
            req.slot = -1

    def _position(self, req: EngineRequest) -> int:
        """Where the row's next decode writes: the position of its last generated token."""
        return len(req.prompt) + len(req.generated) - 1

    def _pages_due(self) -> int:
        """Pages the running rows take at the next decode step: admitting must leave them, or the
        newcomer would be preempted at once."""
        due = 0
        for req, pages in zip(self.rows, self.pages, strict=True):
            if req is not None and pages is not None:
                due += max(0, self.kv.pages_for(self._position(req) + 1) - len(pages.pages))
        return due

    def _grow(self) -> None:
        """Give every running row the page its next position needs, oldest first; preempt the newest
        running requests while the pages do not go round."""
        for row in sorted(
            (i for i, r in enumerate(self.rows) if r is not None), key=self._admitted.__getitem__
        ):
            req, pages = self.rows[row], self.pages[row]
            if req is None or pages is None:
                continue  # preempted below on an earlier row's behalf
            while not self.kv.grow(pages, self._position(req) + 1):
                self._preempt()
                if self.rows[row] is None:
                    break  # it was the newest itself
            if self.rows[row] is not None:
                self._sync_table(row)

    def _preempt(self) -> None:
        """Send the newest running request back to the front of ``ready``, its pages released."""
        row = max((i for i, r in enumerate(self.rows) if r is not None), key=self._admitted.__getitem__)
        req = self.rows[row]
        assert req is not None
        self.rows[row] = None
        self.prefilled[row] = None  # its computed full pages stay cached: the resume starts after them
        self._release_pages(row)
        req.row = -1
        self.ready.appendleft(req)
        with self._lock:
            self._queued += 1  # waiting again, not a new submission: no max_waiting check
        self.preemptions += 1

    def _decode(self) -> bool:
        """One decode step for every row past its prefill; returns whether one ran."""
        self._grow()
        prefilling = self._prefilling()
        if all(r is None for i, r in enumerate(self.rows) if i not in prefilling):
            return False
        b = self.config.max_batch_size
        tokens, positions, slots = np.zeros(b, np.int32), np.zeros(b, np.int32), np.full(b, -1, np.int32)
        sampling: list[SamplingRow | None] = [None] * b
        tables = self.tables
        if prefilling:  # their pages hold a half-computed prompt: they sit this step out like idle rows
            tables = self.tables.copy()
            tables[prefilling] = 0
        for i, req in enumerate(self.rows):
            if req is None or i in prefilling:
                continue
            tokens[i] = req.generated[-1]
            positions[i] = self._position(req)
            slots[i] = req.slot
            sampling[i] = SamplingRow.of(req)
        out = self.runner.decode(tokens, positions, slots, tables, sampling)
        self.steps += 1
        for i, req in enumerate(self.rows):
            if req is not None and i not in prefilling:
                filled = int(positions[i]) + 1
                if filled % self.kv.page_size == 0:  # this step filled a page: cache it
                    self.kv.register(self.pages[i], req.prompt + req.generated, filled)
                self._accept_token(i, out, i)
        return True

    def _accept_token(self, row: int, out: StepOutput, i: int) -> None:
        """Row ``row``'s request takes the token of ``out``'s row ``i`` (and its logprobs if it asked)."""
        req = self.rows[row]
        assert req is not None
        token = int(out.tokens[i])
        want = req.sampling.logprobs
        logprobs = None if want is None else out.logprobs(i, want)
        req.generated.append(token)
        self.tokens_out += 1
        s, n = req.sampling, len(req.generated)
        reason: FinishReason | None = None
        if token in self.eos_ids and not s.ignore_eos:
            reason = FinishReason.EOS
        elif token in s.stop_token_ids:
            reason = FinishReason.STOP
        elif n >= req.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:  # the last token travels with the finish, in one message
            self._finish(row, Finished(reason, len(req.prompt), n, token_id=token, logprobs=logprobs))
        else:
            self._emit(req, Token(token, logprobs))

    def _finish(self, row: int, event: Finished | Failed) -> None:
        req = self.rows[row]
        if req is None:
            return
        self.rows[row] = None
        self.prefilled[row] = None
        self._release_pages(row)
        self._release_slot(req)
        self.requests_done += 1
        self._emit(req, event)
