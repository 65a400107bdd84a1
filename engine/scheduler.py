"""The host side of the engine: queues, decode rows, KV pages, admission, preemption, cancellation,
deadlines, finishes.

Requests live in one of three places: ``waiting`` (their adapter is not resident yet; ``held`` while it is
resident in a slot being drained for another adapter, fair sharing), ``ready`` (they
hold a slot reference and wait for a free decode row and enough KV pages) or ``rows`` (a ``Row`` each:
the request, its KV pages, its admission order and, while its prompt is chunked, how much of it is
computed; the rows' page tables are ``tables``, the array the runner takes, idle rows' all 0). ``handle``
applies one command (``Submit``, ``Cancel``, or a residency command); ``step`` places prepared adapters,
expires deadlines, admits up to ``prefill_per_step`` prompts and runs one decode step on the ``Runner``.

KV pages (``engine.kv_pages``): the head of ``ready`` is admitted only when the pages of its prompt that
the prefix cache does not hold, plus the page of its first decode token, can be had (free or reclaimable)
besides the pages the running rows take at the next step; otherwise admission stops there (FIFO, nobody
jumps ahead). Before each decode step a row whose next
position starts a page gets one; when none is left the newest running request is preempted: its pages are
released (full computed pages stay cached), it keeps its slot reference and generated tokens and goes back
to the FRONT of ``ready``; its resume is a prefill of prompt + generated from the cached hits on, which
samples the next new token, so nothing streamed is repeated or lost.
Events and future results wait in ``outbox`` until ``flush``: the engine publishes the snapshot first, so
whoever sees an event also sees its effect in ``engine.snapshot()``. Everything here runs on the engine
thread, except ``accept`` and ``cancelling`` (callers' threads). No JAX here.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
import numpy as np

from loraserve.adapters.mixes import is_mix, parse_mix, validate_mix
from loraserve.adapters.refs import parse_ref
from loraserve.adapters.running_caps import Cap, RunningCaps, adapter_names
from loraserve.common.admission import DrainRate, retry_after
from loraserve.common.errors import ResourceExhausted
from loraserve.common.finish_reasons import FinishReason
from loraserve.engine.config import EngineConfig
from loraserve.engine.kv_pages import BASE_KEY, KVCache, SeqPages
from loraserve.engine.request import (
    EngineRequest,
    Failed,
    Finished,
    SamplingRow,
    Started,
    Token,
    validate_prediction,
    validate_prompt,
)
from loraserve.engine.residency import (
    Drained,
    Evicted,
    Load,
    LoadFailed,
    Outcome,
    Prepared,
    Residency,
    Resident,
    Unload,
)
from loraserve.engine.runner import PrefillInput, Runner, StepOutput
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.engine.speculative import (
    MAX_TRY_REST,
    PREDICTED_RATE,
    AdapterRates,
    DraftState,
    NgramDrafter,
    StepCosts,
    predicted,
)
from loraserve.models.config import ModelConfig

NO_ROOM = Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "the request needs more KV pages than the pool holds")
CANCELLED = Failed(grpc.StatusCode.CANCELLED, "cancelled by the client")
DEADLINE = Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")


@dataclass(frozen=True)
class Submit:
    request: EngineRequest


@dataclass(frozen=True)
class Cancel:
    """End ``request_id`` now (``Scheduler.cancelling`` makes it); ``reason`` labels
    ``loraserve_requests_cancelled_total``: ``client`` (its stream went away), ``deadline`` (its deadline
    passed at the servicer), ``stop_string`` (a stop string ended it while the engine still decoded it)."""

    request_id: str
    reason: str = "client"


CANCEL_REASONS = ("client", "deadline", "stop_string")
# loraserve_tokens_after_cancel's buckets: tokens a request took after its cancel was posted. The bound is one
# engine step: the step running when the cancel arrives (its prefill's first token and its decode's token)
# plus, with async decode, the step dispatched before it, which the cancel reads before it ends the row.
AFTER_CANCEL_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 64)


@dataclass
class Row:
    """A decode row's request and what the scheduler keeps for it."""

    req: EngineRequest
    pages: SeqPages
    admitted: int  # admission order (the newest running request has the largest)
    prefilled: int | None = None  # tokens computed while the prompt is chunked; None once it decodes


@dataclass(frozen=True)
class _InFlight:
    """A decode step dispatched and not yet read (async decode, ``EngineConfig.async_decode``): the runner's
    handle, the rows it computes (index, row) and the positions it writes."""

    handle: object
    rows: list[tuple[int, Row]]
    positions: np.ndarray


@dataclass
class _Prefill:
    """One step's packed prefill as it is planned: the runner's inputs, whose rows they are, whether each
    is its row's final chunk, and the step's token budget left (None: no limit)."""

    budget: int | None
    inputs: list[PrefillInput] = field(default_factory=list)
    parts: list[tuple[int, Row, bool]] = field(default_factory=list)  # (row index, row, final chunk)

    @property
    def spent(self) -> bool:
        return self.budget == 0


class _Running:
    """This step's running requests per capped adapter name and tenant, as admission adds to them."""

    def __init__(self, caps: dict[str, Cap], reqs: Iterable[EngineRequest]) -> None:
        self.caps = caps
        self.names: dict[str, int] = {}
        self.tenants: dict[str, int] = {}
        if caps:
            for req in reqs:
                self.add(req)

    def _capped_names(self, req: EngineRequest) -> list[tuple[str, Cap]]:
        return [(n, cap) for n in adapter_names(req.key or req.adapter) if (cap := self.caps.get(n))]

    def add(self, req: EngineRequest) -> None:
        if not self.caps:
            return
        tenants = set()
        for name, cap in self._capped_names(req):
            self.names[name] = self.names.get(name, 0) + 1
            if cap.tenant:
                tenants.add(cap.tenant)
        for tenant in tenants:  # a mix of one tenant's adapters is one of its requests
            self.tenants[tenant] = self.tenants.get(tenant, 0) + 1

    def capped(self, req: EngineRequest) -> bool:
        """Whether admitting ``req`` would take its name or its tenant past a cap."""
        if not self.caps:
            return False
        for name, cap in self._capped_names(req):
            if cap.max_running and self.names.get(name, 0) >= cap.max_running:
                return True
            if cap.tenant_max_running and self.tenants.get(cap.tenant, 0) >= cap.tenant_max_running:
                return True
        return False


class Scheduler:
    def __init__(
        self,
        runner: Runner,
        residency: Residency,
        model_config: ModelConfig,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        caps: RunningCaps | None = None,
    ) -> None:
        self.runner, self.residency, self.model_config, self.config = runner, residency, model_config, config
        self.clock = clock
        # running caps per adapter name and tenant (adapters.running_caps; set in the registry)
        self.caps = caps or RunningCaps()
        self.eos_ids = frozenset(model_config.eos_token_ids)
        self.waiting: deque[EngineRequest] = deque()
        self.ready: deque[EngineRequest] = deque()
        # requests for an adapter whose slot is being drained (fair sharing, engine.residency): they wait
        # for its turn to come round again, then ask afresh (Drained)
        self.held: deque[EngineRequest] = deque()
        self.rows: list[Row | None] = [None] * config.max_batch_size
        if runner.page_size != config.kv_page_size:
            raise ValueError(
                f"runner pages hold {runner.page_size} tokens, the config says {config.kv_page_size}"
            )
        # this step's KV events (engine.kv_events), when the engine publishes them (--kv-events)
        self.kv_events: list | None = [] if config.kv_events else None
        self.kv = KVCache(runner.num_pages, runner.page_size, config.enable_prefix_caching, self.kv_events)
        self.tables = np.zeros((config.max_batch_size, config.pages_per_row), np.int32)
        # early ends by reason (Cancel's, and "deadline" for the engine's own expiries too); per request whose
        # cancel is posted and not yet handled, the tokens it took since (guarded by _lock: posted anywhere);
        # per cancel that ended a request, those tokens by AFTER_CANCEL_BUCKETS (the last: more)
        self.cancelled = dict.fromkeys(CANCEL_REASONS, 0)
        self._cancelling: dict[str, int] = {}
        self.after_cancel = [0] * (len(AFTER_CANCEL_BUCKETS) + 1)
        self.after_cancel_tokens = 0
        self._admissions = 0
        self.steps = self.tokens_out = self.requests_done = self.preemptions = 0
        self.chained = 0  # decode steps dispatched before the step in flight was read (async decode)
        self.outbox: list[Callable[[], None]] = []  # events, delivered by flush() after the snapshot
        self._queued = 0  # accepted, not yet in a row nor ended (guarded by _lock: accept runs anywhere)
        self.drain = DrainRate()  # places the queue frees per second: the wait a refusal announces
        self._lock = threading.Lock()
        # async decode: the next step is dispatched before this one's tokens are read, while the batch runs
        # unchanged (_may_chain); anything else reads the step in flight first (_settle)
        self._async = config.async_decode and runner.chains
        self._inflight: _InFlight | None = None
        # speculative decoding (docs/speculative.md): the drafter, the steps' measured costs (the rule choosing
        # a verify step), and verify steps, tokens proposed and kept
        self.drafter = NgramDrafter() if config.speculative == "ngram" else None
        self.costs = StepCosts() if self.drafter is not None else None
        self.spec_steps = self.spec_proposed = self.spec_accepted = 0
        self.adapter_rates = AdapterRates()  # what each adapter's n-gram drafts keep: its new rows' prior
        # a look for drafts costs host time every step (each row's n-gram search, ~35 us a row of 128 tokens)
        # and reads the step in flight (drafts continue from its tokens): after a look that ran no verify step
        # the next looks wait 1, 3, 7, 15 steps (at most MAX_TRY_REST) until one runs or a row is admitted
        self._try_rest = self._try_gap = 0
        self._decode_at: float | None = None  # when the last decode step was dispatched (its pipelined cost)

    # ----------------------------------------------------------------- any thread
    def accept(self, req: EngineRequest) -> Submit:
        """Validate and count ``req`` against ``max_waiting``; raises InvalidArgument / ResourceExhausted."""
        cfg = self.model_config
        validate_prompt(req.prompt, cfg.vocab_size, self.config.max_seq_len)
        req.sampling.validate(cfg.vocab_size)
        if req.prediction:
            validate_prediction(req.prediction, cfg.vocab_size)
        if req.adapter and is_mix(req.adapter):  # a weighted mix (adapters.mixes): its parts and weights
            validate_mix(parse_mix(req.adapter), self.config.max_mix)
        elif req.adapter:
            parse_ref(req.adapter)  # an AdapterError (INVALID_ARGUMENT) for a malformed ref
        room = self.config.max_seq_len - len(req.prompt)
        wanted = 0 if req.sampling.prompt_only else req.sampling.max_tokens or self.config.default_max_tokens
        req.max_new_tokens = min(wanted, room)
        req.seed = req.sampling.resolved_seed()
        with self._lock:
            refused = self.refusal()
            if refused is not None:
                raise refused
            self._queued += 1
        return Submit(req)

    def refusal(self) -> ResourceExhausted | None:
        """The refusal a request gets now (its queue is full: ``max_waiting`` waiting), else None. Any thread;
        cheap, so the servers ask it before anything else (``common.admission``). The wait it announces is
        the time the queue takes to free a place at its measured drain rate."""
        queued, limit = self._queued, self.config.max_waiting
        if queued < limit:
            return None
        wait = retry_after(queued - limit + 1, self.drain.rate())
        return ResourceExhausted(f"queue is full ({limit} waiting)", retry_after=wait)

    @property
    def queued(self) -> int:
        return self._queued

    # ----------------------------------------------------------------- engine thread
    def handle(self, command: Submit | Cancel | Load | Unload | Prepared) -> None:
        self._settle()  # a command may change the rows: the step in flight is read first
        match command:
            case Submit(req):
                self._submit(req)
            case Cancel(request_id, reason):
                self._cancel(request_id, reason)
            case Load() | Unload() | Prepared():
                self._apply(self.residency.handle(command))
            case _:
                raise TypeError(f"the scheduler has no command {type(command).__name__}")

    def step(self) -> bool:
        """One round; returns whether a prefill or a decode step ran (False = idle)."""
        if self._inflight is not None and (
            self.ready or self.waiting or self._prefilling() or self._expiring()
        ):
            self._settle()
        self._apply(self.residency.place_pending())
        self._expire()
        prefilled = self._admit()
        return self._decode() or prefilled

    def fail_running(self, event: Failed) -> None:
        self._inflight = None  # its step failed with the rest: nothing to read
        for i in range(len(self.rows)):
            self._finish(i, event)

    def _running(self) -> list[tuple[int, Row]]:
        """The occupied rows, by row index."""
        return [(i, row) for i, row in enumerate(self.rows) if row is not None]

    def flush(self) -> None:
        """Deliver the events and future results of the last commands/step (after publishing a snapshot)."""
        calls, self.outbox, self.residency.outbox = self.residency.outbox + self.outbox, [], []
        for call in calls:
            call()

    def _emit(self, req: EngineRequest, event) -> None:
        self.outbox.append(lambda: req.emit(event))

    def snapshot(self) -> EngineSnapshot:
        rows = [row.req for _, row in self._running()]
        res = self.residency
        return EngineSnapshot(
            step=self.steps,
            slots=res.table.slots(),
            running=len(rows),
            waiting=self._queued,
            running_adapters=tuple(sorted({r.key for r in rows if r.key})),
            waiting_adapters=tuple(
                sorted({r.adapter for r in (*self.waiting, *self.ready, *self.held) if r.adapter})
            ),
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
            cancelled=tuple(self.cancelled.items()),
            after_cancel=tuple(self.after_cancel),
            after_cancel_tokens=self.after_cancel_tokens,
            spec_steps=self.spec_steps,
            spec_proposed=self.spec_proposed,
            spec_accepted=self.spec_accepted,
            spec_probes=self.costs.probes if self.costs is not None else 0,
            spec_cost_ratio=(self.costs.ratio or 0.0) if self.costs is not None else 0.0,
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
        if self.residency.is_draining(req.adapter):  # its slot is changing hands: wait for its turn
            self.held.append(req)
            return
        self.waiting.append(req)
        self.residency.want(req.adapter)

    def cancelling(self, request_id: str, reason: str = "client") -> Cancel:
        """The command that cancels ``request_id`` (any thread): from now until it is handled, every token the
        request takes is counted as taken after its cancel (``loraserve_tokens_after_cancel``)."""
        with self._lock:
            self._cancelling[request_id] = 0
        return Cancel(request_id, reason)

    def _cancel(self, request_id: str, reason: str) -> None:
        with self._lock:
            after = self._cancelling.pop(request_id, 0)
        for i, row in self._running():
            if row.req.request_id == request_id:
                self._finish(i, CANCELLED)
                break
        else:
            if not self._drop(lambda r: r.request_id == request_id, CANCELLED):
                return  # it had ended already (finished, failed, or an unknown id): nothing was cancelled
        self.cancelled[reason] = self.cancelled.get(reason, 0) + 1
        self.after_cancel[bisect.bisect_left(AFTER_CANCEL_BUCKETS, after)] += 1  # the first bound >= after
        self.after_cancel_tokens += after

    def _taken_after_cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._cancelling:
                self._cancelling[request_id] += 1

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
                case Drained():  # let the held-back requests ask again, in their order
                    held, self.held = self.held, deque()
                    for req in held:
                        self._submit(req)
                case Evicted(index, key):
                    gone = Failed(grpc.StatusCode.UNAVAILABLE, f"adapter {key} was unloaded")
                    for i, row in self._running():
                        if row.req.slot == index:
                            row.req.slot = -1  # the slot is already cleared: nothing to release
                            self._finish(i, gone)
                    holders = [r for r in self.ready if r.slot == index]
                    for req in holders:
                        req.slot = -1
                    self._drop(lambda r, holders=holders: r in holders, gone, (self.ready,))
                case _:
                    raise TypeError(f"the scheduler has no outcome {type(outcome).__name__}")

    def _drop(
        self, match: Callable[[EngineRequest], bool], event: Failed, queues: tuple[deque, ...] = ()
    ) -> int:
        """End the queued (not running) requests that ``match`` selects with ``event``; returns how many."""
        dropped = 0
        for queue in queues or (self.ready, self.waiting, self.held):
            for req in [r for r in queue if match(r)]:
                dropped += 1
                queue.remove(req)
                self._dequeued()
                self._release_slot(req)
                self._emit(req, event)
                if queue is self.waiting and all(r.adapter != req.adapter for r in self.waiting):
                    self.residency.abandon(req.adapter)  # its last waiter: the load is not needed
        return dropped

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1
        self.drain.note()

    def _expiring(self) -> bool:
        now = self.clock()
        return any(row.req.deadline is not None and row.req.deadline <= now for _, row in self._running())

    def _expire(self) -> None:
        now = self.clock()
        expired = 0
        for i, row in self._running():
            if row.req.deadline is not None and row.req.deadline <= now:
                self._finish(i, DEADLINE)
                expired += 1
        expired += self._drop(lambda r: r.deadline is not None and r.deadline <= now, DEADLINE)
        self.cancelled["deadline"] += expired

    # ----------------------------------------------------------------- prefill / decode
    def _admit(self) -> bool:
        """This step's prefill; returns whether one ran.

        First the next chunk of every row still prefilling (oldest first), then ready requests in FIFO
        order, up to ``prefill_per_step`` of them, while rows, pages and the step's token budget last. The
        budget is ``prefill_chunk`` tokens (0 = none: every prompt whole): a longer prompt is computed
        a chunk per step, each step's decode runs in between, so a newcomer's prompt never stalls the
        running rows for longer than one chunk. All of it goes to the runner as one packed prefill; a
        row's last chunk samples its first token (an earlier chunk's sample is dropped)."""
        plan = _Prefill(self.config.prefill_chunk or None)
        self._next_chunks(plan)
        self._admit_ready(plan)
        if not plan.inputs:
            return False
        self._run_prefill(plan)
        return True

    def _next_chunks(self, plan: _Prefill) -> None:
        """The next chunk of every row still prefilling, oldest first, while the budget lasts."""
        for i, row in sorted(self._prefilling(), key=lambda r: r[1].admitted):
            if plan.spent:
                return
            assert row.prefilled is not None
            self._take(plan, i, row, row.req.prompt + row.req.generated, row.prefilled)

    def _admit_ready(self, plan: _Prefill) -> None:
        """Ready requests in FIFO order into free rows, while rows, pages and the budget last. A request
        that could never fit the pool ends with NO_ROOM; one that must wait for pages stops admission
        (nobody behind it goes first). A request whose adapter name or tenant runs its cap's worth of rows
        (running caps) stays where it is and the ones behind it go ahead: a capped flood cannot block them."""
        admitted, at = 0, 0
        running = _Running(self.caps.table(), (row.req for _, row in self._running()))
        while at < len(self.ready) and admitted < self.config.prefill_per_step and not plan.spent:
            try:
                i = self.rows.index(None)
            except ValueError:
                return
            req = self.ready[at]
            if running.capped(req):
                at += 1
                continue
            seq = req.prompt + req.generated  # prompt + what was streamed before a preemption
            key = self._adapter_key(req)
            # a request scoring its prompt computes all of it: no logprobs are kept for cached pages
            scoring = req.sampling.prompt_logprobs is not None and not req.generated
            lookup = self.kv.lookup(
                key, seq, reserve=1, cached=not scoring
            )  # + the first decode token's page
            if lookup.hits + lookup.new_pages > self.kv.total:  # config keeps one context in the pool
                del self.ready[at]
                self._dequeued()
                self._release_slot(req)
                self._emit(req, NO_ROOM)
                continue
            if not self.kv.can_take(lookup, spare=self._pages_due()):
                return
            del self.ready[at]
            running.add(req)
            self._dequeued()
            req.prompt_scores = [] if scoring else None
            row = self._place(i, req, self.kv.admit(key, seq, lookup, req.key or req.adapter or None))
            if req.sampling.controlled:  # the row's history on the device: what its controls read
                self.runner.seed_history(
                    i, req.prompt, req.generated, req.sampling.bias_entries(self.eos_ids)
                )
            self._take(plan, i, row, seq, lookup.hits * self.kv.page_size)
            admitted += 1

    def _take(self, plan: _Prefill, i: int, row: Row, seq: list[int], start: int) -> None:
        """Row ``i`` computes ``seq`` from ``start`` in this step's prefill, as far as the budget goes."""
        end = len(seq) if plan.budget is None else min(len(seq), start + plan.budget)
        if plan.budget is not None:
            plan.budget -= end - start
        table = self.tables[i].copy()  # the runner may hold on to it (a zero-copy device array)
        targets = None
        if row.req.prompt_scores is not None:  # each position scores the prompt token after it
            n = len(row.req.prompt)
            targets = [seq[p + 1] if p + 1 < n else -1 for p in range(start, end)]
        final = end == len(seq)
        history = i if final and row.req.sampling.controlled else -1  # an earlier chunk's sample is dropped
        plan.inputs.append(
            PrefillInput(
                seq[start:end], start, row.req.slot, table, SamplingRow.of(row.req, final), targets, history
            )
        )
        row.prefilled = None if final else end
        plan.parts.append((i, row, final))
        # registered now, computed by the prefill below: a later prompt of this same batch may share
        # them (the runner writes every sequence's keys/values before any of them attends)
        self.kv.register(row.pages, seq, end)

    def _run_prefill(self, plan: _Prefill) -> None:
        """Run the planned prefill; each row whose last chunk it was starts (with its prompt's logprobs
        when it asked) and takes its first token, or finishes when it asked for none."""
        try:
            out = self.runner.prefill(plan.inputs)
        except BaseException:
            for _, row, _ in plan.parts:
                self.kv.forget(row.pages)
            raise
        assert len(out.tokens) == len(plan.parts), (len(out.tokens), len(plan.parts))
        for n, (i, row, final) in enumerate(plan.parts):
            req = row.req
            if req.prompt_scores is not None:
                want = req.sampling.prompt_logprobs or 0
                req.prompt_scores.extend(lp.cut(want) for lp in out.prompt_logprobs(n))
            if not final:
                continue
            if not req.generated:
                scores, req.prompt_scores = req.prompt_scores, None
                self._emit(req, Started(req.key, None if scores is None else tuple(scores)))
            if req.max_new_tokens == 0:  # prompt_only: the prompt was all it asked for
                self._finish(i, Finished(FinishReason.LENGTH, len(req.prompt), 0))
                continue
            self._accept_token(i, out, n)

    def _prefilling(self) -> list[tuple[int, Row]]:
        """Rows whose prompt is still being computed, a chunk per step (they take no decode step yet)."""
        return [(i, row) for i, row in self._running() if row.prefilled is not None]

    def _adapter_key(self, req: EngineRequest) -> str:
        """The prefix cache's key for ``req``'s pages: its slot's adapter content sha256, or the base's."""
        if req.slot < 0:
            return BASE_KEY
        sha = self.residency.table.slots()[req.slot].sha256
        assert sha, f"slot {req.slot} holds no adapter content"
        return sha

    def _place(self, i: int, req: EngineRequest, pages: SeqPages) -> Row:
        self._admissions += 1
        req.row = i
        row = self.rows[i] = Row(req, pages, self._admissions)
        self._try_rest = self._try_gap = 0  # a new row may have drafts (a prediction): look at the next step
        self._sync_table(i)
        return row

    def _sync_table(self, i: int) -> None:
        row = self.rows[i]
        self.tables[i] = 0
        if row is not None:
            self.tables[i, : len(row.pages.pages)] = row.pages.pages

    def _vacate(self, i: int) -> Row | None:
        """Empty row ``i``: its pages go back to the cache (full computed pages stay cached)."""
        row, self.rows[i] = self.rows[i], None
        if row is not None:
            self.kv.release(row.pages)
        self.tables[i] = 0
        return row

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
        return sum(
            max(0, self.kv.pages_for(self._position(row.req) + 1) - len(row.pages.pages))
            for _, row in self._running()
        )

    def _grow(self) -> None:
        """Give every running row the page its next position needs, oldest first; preempt the newest
        running requests while the pages do not go round."""
        for i, row in sorted(self._running(), key=lambda r: r[1].admitted):
            if self.rows[i] is not row:
                continue  # preempted below on an earlier row's behalf
            while not self.kv.grow(row.pages, self._position(row.req) + 1):
                self._preempt()
                if self.rows[i] is not row:
                    break  # it was the newest itself
            if self.rows[i] is row:
                self._sync_table(i)

    def _preempt(self) -> None:
        """Send the newest running request back to the front of ``ready``, its pages released."""
        i, _ = max(self._running(), key=lambda r: r[1].admitted)
        row = self._vacate(i)  # its computed full pages stay cached: the resume starts after them
        assert row is not None
        row.req.row = -1
        self.ready.appendleft(row.req)
        with self._lock:
            self._queued += 1  # waiting again, not a new submission: no max_waiting check
        self.preemptions += 1

    def _speculate(self) -> bool:
        """A verify step instead of a decode step (docs/speculative.md), when the drafter proposes tokens for
        some row, every decoding row may speculate (no logits controls, structured output or logprobs) and the
        drafts' expected kept tokens pay for the step (:meth:`StepCosts.worth`); returns whether one ran. A row
        the drafter proposes nothing for, or whose pages for its drafts do not go round, verifies its last token
        alone: one token, as a decode step gives."""
        self._settle()
        self._grow()
        decoding = [(i, row) for i, row in self._running() if row.prefilled is None]
        if not decoding or any(
            row.req.grammar is not None
            or row.req.sampling.controlled
            or row.req.sampling.logprobs is not None
            for _, row in decoding
        ):
            return False
        assert self.drafter is not None and self.costs is not None
        b, k = self.config.max_batch_size, self.config.num_speculative_tokens
        drafts, lens = np.zeros((b, k), np.int32), np.zeros(b, np.int32)
        expected = 0.0
        for i, row in decoding:
            req = row.req
            state = self._drafting(req)
            room = min(state.wanted(), req.max_new_tokens - len(req.generated) - 1)  # the last: the target's
            if room <= 0:
                draft = []
            elif req.prediction:  # the caller's predicted output
                draft = predicted(req.prediction, req.generated, room)
            else:
                draft = self.drafter.propose(self._recent(req), room)
            if len(draft):
                drafts[i, : len(draft)], lens[i] = draft, len(draft)
                expected += state.expected(len(draft))
        if not self.costs.worth(expected, len(decoding)):
            return False
        for i, row in decoding:
            if lens[i] and not self.kv.grow(row.pages, self._position(row.req) + int(lens[i]) + 1):
                drafts[i], lens[i] = 0, 0  # no preemption for a draft
            elif lens[i]:
                self._sync_table(i)
        if not lens.any():
            return False
        tokens, positions, slots = np.zeros(b, np.int32), np.zeros(b, np.int32), np.full(b, -1, np.int32)
        sampling: list[SamplingRow | None] = [None] * b
        tables = self.tables
        if len(decoding) < len(self._running()):  # rows holding a half-computed prompt sit this step out
            tables = np.zeros_like(self.tables)
            tables[[i for i, _ in decoding]] = self.tables[[i for i, _ in decoding]]
        for i, row in decoding:
            tokens[i], positions[i], slots[i] = row.req.generated[-1], self._position(row.req), row.req.slot
            sampling[i] = SamplingRow.of(row.req)
        t0 = time.perf_counter()
        accepted, out = self.runner.verify(tokens, positions, slots, tables, drafts, lens, sampling)
        self.steps += 1
        self.spec_steps += 1
        self.spec_proposed += int(lens.sum())
        for i, row in decoding:
            kept, proposed = int(accepted[i]), int(lens[i])
            req, first = row.req, int(positions[i])
            if proposed:
                assert req.drafting is not None
                req.drafting.update(proposed, kept)
                if not req.prediction:  # the adapter's n-gram drafts (a prediction says nothing of them)
                    self.adapter_rates.update(req.adapter, proposed, kept)
                req.draft_tokens += proposed
                req.accepted_draft_tokens += kept
                self.spec_accepted += kept
            # a page this step filled with the k/v of kept tokens (its last token and the kept drafts): cached
            if (first + kept + 1) // self.kv.page_size > first // self.kv.page_size:
                inputs = req.prompt + req.generated + drafts[i, :kept].tolist()
                self.kv.register(row.pages, inputs, first + kept + 1)
            for token in out[i, : kept + 1].tolist():
                if self.rows[i] is not row:
                    break  # it ended (a stop, EOS, its length): the rest is dropped
                self._take_token(i, int(token), None)
        self.costs.observe("verify", time.perf_counter() - t0)
        return True

    def _drafting(self, req: EngineRequest) -> DraftState:
        """``req``'s drafting state, made at its first step: it proposes up to its request's k (else the
        server's; never more: the verify step's shape), or nothing when its request turned speculation off;
        a row with a prediction starts at :data:`PREDICTED_RATE`, others at what their adapter's n-gram drafts
        kept (:class:`AdapterRates`)."""
        if req.drafting is None:
            s, k = req.sampling, self.config.num_speculative_tokens
            on = (s.speculative or self.config.speculative) != "off"
            limit = min(s.num_speculative_tokens or k, k) if on else 0
            # a caller's prediction is meant to be the answer: its rows start out expected to keep drafts; the
            # others from what their adapter's n-gram drafts kept so far (PRIOR_RATE before any)
            rate = PREDICTED_RATE if req.prediction else self.adapter_rates.get(req.adapter)
            req.drafting = DraftState(limit, rate=rate)
        return req.drafting

    def _recent(self, req: EngineRequest) -> list[int]:
        """The last tokens of ``req``'s prompt and output the drafter searches (its window): a copy of those
        only, whatever the prompt's length."""
        window = self.drafter.window
        tail = req.generated[-window:]
        return tail if len(tail) == window else req.prompt[len(tail) - window :] + tail

    def _decode(self) -> bool:
        """One decode step for every row past its prefill; returns whether one ran. With async decode the step
        stays in flight and the one before it (if any) is read after this one is dispatched."""
        if self.drafter is not None:
            if self._try_rest > 0:
                self._try_rest -= 1
            elif self._speculate():
                self._try_gap = 0
                return True
            else:
                self._try_gap = self._try_rest = min(2 * self._try_gap + 1, MAX_TRY_REST)
        chained = self._inflight is not None and self._may_chain()
        if not chained:
            self._settle()
            self._grow()
        decoding = [(i, row) for i, row in self._running() if row.prefilled is None]
        if not decoding:
            return False
        ahead = 1 if chained else 0  # the token the step in flight draws, not yet in generated
        b = self.config.max_batch_size
        tokens, positions, slots = np.zeros(b, np.int32), np.zeros(b, np.int32), np.full(b, -1, np.int32)
        sampling: list[SamplingRow | None] = [None] * b
        tables = self.tables
        if len(decoding) < len(self._running()):  # rows holding a half-computed prompt sit this step out
            tables = np.zeros_like(self.tables)
            rows = [i for i, _ in decoding]
            tables[rows] = self.tables[rows]
        for i, row in decoding:
            tokens[i] = row.req.generated[-1]  # (chained: the step in flight's draw replaces it)
            positions[i] = self._position(row.req) + ahead
            slots[i] = row.req.slot
            sampling[i] = SamplingRow.of(row.req, ahead=ahead)
        before = self._inflight
        follow = before.handle if chained and before is not None else None
        t0 = time.perf_counter()
        handle = self.runner.decode_start(tokens, positions, slots, tables, sampling, follow)
        self.steps += 1
        self.chained += chained
        self._inflight = _InFlight(handle, decoding, positions)
        if before is not None:  # chained: its tokens are read while this step runs
            self._read(before)
        if self.costs is not None:  # speculation on: the verify rule's decode cost
            if chained and self._decode_at is not None:  # pipelined: dispatch to dispatch is one step's cost
                self.costs.observe("decode", t0 - self._decode_at)
            elif not self._async or self.costs.seconds("decode") is None:  # a step alone, read and timed
                self._settle()
                self.costs.observe("decode", time.perf_counter() - t0)
            self._decode_at = t0
        elif not self._async:
            self._settle()
        return True

    def _may_chain(self) -> bool:
        """Whether the next step can be dispatched before the step in flight is read: async decode, the same
        rows still decoding and none prefilling, no structured output (its mask needs the last token), no row
        whose step in flight is its last by length, and every row's page for the position after it at hand
        (no preemption)."""
        assert self._inflight is not None
        rows, running = self._inflight.rows, self._running()
        if not self._async or len(running) != len(rows):
            return False
        for (i, row), (j, now) in zip(rows, running, strict=True):
            req = row.req
            if (
                i != j
                or now is not row
                or req.grammar is not None
                or len(req.generated) + 1 >= req.max_new_tokens
            ):
                return False
        for i, row in rows:
            grown = self.kv.grow(row.pages, self._position(row.req) + 2)
            self._sync_table(i)
            if not grown:
                return False
        return True

    def _settle(self) -> None:
        """Read the step in flight, if any."""
        before, self._inflight = self._inflight, None
        if before is not None:
            self._read(before)

    def _read(self, step: _InFlight) -> None:
        """A dispatched step's tokens, to the rows it computed that still hold the same request (one that
        ended or was preempted while its step ran drops the token)."""
        out = self.runner.decode_finish(step.handle)
        for i, row in step.rows:
            if self.rows[i] is not row:
                continue
            filled = int(step.positions[i]) + 1
            if filled % self.kv.page_size == 0:  # this step filled a page: cache it
                self.kv.register(row.pages, row.req.prompt + row.req.generated, filled)
            self._accept_token(i, out, i)

    def _accept_token(self, row: int, out: StepOutput, i: int) -> None:
        """Row ``row``'s request takes the token of ``out``'s row ``i`` (and its logprobs if it asked)."""
        held = self.rows[row]
        assert held is not None
        want = held.req.sampling.logprobs
        self._take_token(row, int(out.tokens[i]), None if want is None else out.logprobs(i, want))

    def _take_token(self, row: int, token: int, logprobs) -> None:
        """Row ``row``'s request takes ``token``: streamed, or its last one with the finish it causes."""
        held = self.rows[row]
        assert held is not None
        req = held.req
        req.generated.append(token)
        self.tokens_out += 1
        if self._cancelling:  # a cancel is on its way to this thread: is this token spent on a client gone?
            self._taken_after_cancel(req.request_id)
        s, n = req.sampling, len(req.generated)
        reason: FinishReason | None = None
        if token in self.eos_ids and not s.ignore_eos:
            reason = FinishReason.EOS
        elif req.grammar is not None and not req.grammar.accept(token):  # drawn under its mask: never
            self._finish(
                row, Failed(grpc.StatusCode.INTERNAL, f"the structured output refused token {token}")
            )
            return
        elif token in s.stop_token_ids or (req.grammar is not None and req.grammar.stopped):
            reason = FinishReason.STOP  # a stop token, or the structured output is complete
        elif n >= req.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:  # the last token travels with the finish, in one message
            self._finish(row, Finished(reason, len(req.prompt), n, token_id=token, logprobs=logprobs))
        else:
            self._emit(req, Token(token, logprobs))

    def _finish(self, i: int, event: Finished | Failed) -> None:
        row = self._vacate(i)
        if row is None:
            return
        self._release_slot(row.req)
        self.requests_done += 1
        self._emit(row.req, event)
