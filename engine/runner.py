"""The device side of the engine as a protocol: what the host-side scheduler asks of a model runner.

``engine.jax_runner.JaxRunner`` is the real one (jitted, donated, never recompiling after ``warmup``);
``engine.fake_runner.FakeRunner`` makes arithmetic tokens so the scheduler can be tested in milliseconds.
Every method is called from the engine thread, except ``prepare`` (loader threads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from loraserve.adapters.peft import LoraWeights
from loraserve.engine.request import SamplingRow, TokenLogprobs


@dataclass(frozen=True)
class PrefillInput:
    """One sequence of a packed prefill: its new ``tokens`` at positions ``start ..`` under adapter
    ``slot`` (-1 = base), its ``page_table`` (``[pages_per_row]`` int32) and sampling row. ``targets``
    (prompt log-probabilities): per new token, the prompt token after it, whose log-probability to report
    (-1: none); None scores nothing. ``row``: the decode row whose history the logits controls read and
    the sampled token is recorded in (``Runner.seed_history``); -1 for a sequence without controls, or
    whose sample is dropped (a chunk before the prompt's last)."""

    tokens: list[int]
    start: int
    slot: int
    page_table: np.ndarray
    sampling: SamplingRow
    targets: list[int] | None = None
    row: int = -1


PromptLogprobs = tuple[TokenLogprobs, ...]  # one per scored target, in order, with all K alternatives


@dataclass(frozen=True)
class StepOutput:
    """What one prefill or decode drew for its B rows (prefill: one row per sequence, in order). The
    logprob arrays are host copies, present only when some row asked (``SamplingRow.logprobs``); rows
    that did not ask hold zeros there."""

    tokens: np.ndarray  # [B] int32
    logprob: np.ndarray | None = None  # [B] f32, the token's log-probability (raw distribution)
    top_ids: np.ndarray | None = None  # [B, K] int32, the K most likely tokens, most likely first
    top_logprobs: np.ndarray | None = None  # [B, K] f32
    # prefill: per row, its scored targets' logprobs (PrefillInput.targets), None for a row that scored
    # none; None when no row did
    prompt: tuple[PromptLogprobs | None, ...] | None = None

    def logprobs(self, row: int, n: int) -> TokenLogprobs:
        """Row ``row``'s token logprob and its ``n`` (<= K) most likely alternatives; the row asked."""
        assert self.logprob is not None and self.top_ids is not None and self.top_logprobs is not None
        return TokenLogprobs(
            float(self.logprob[row]),
            tuple(self.top_ids[row, :n].tolist()),
            tuple(self.top_logprobs[row, :n].tolist()),
        )

    def head(self, n: int) -> StepOutput:
        """The first ``n`` rows."""
        cut = [None if a is None else a[:n] for a in (self.logprob, self.top_ids, self.top_logprobs)]
        return StepOutput(self.tokens[:n], *cut, prompt=None if self.prompt is None else self.prompt[:n])

    def prompt_logprobs(self, row: int) -> PromptLogprobs:
        """Row ``row``'s scored targets (empty when it scored none)."""
        return () if self.prompt is None else self.prompt[row] or ()

    @staticmethod
    def concat(parts: Sequence[StepOutput]) -> StepOutput:
        """The rows of ``parts`` in order; when some part has logprobs, the others' rows get zeros there."""
        tokens = np.concatenate([p.tokens for p in parts])
        prompt = None
        if any(p.prompt is not None for p in parts):
            prompt = tuple(x for p in parts for x in (p.prompt or (None,) * len(p.tokens)))
        have = [p for p in parts if p.logprob is not None]
        if not have:
            return StepOutput(tokens, prompt=prompt)
        k = have[0].top_ids.shape[1]

        def rows(p: StepOutput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            if p.logprob is not None:
                return p.logprob, p.top_ids, p.top_logprobs
            b = len(p.tokens)
            return np.zeros(b, np.float32), np.zeros((b, k), np.int32), np.zeros((b, k), np.float32)

        lp, ids, top = zip(*(rows(p) for p in parts), strict=True)
        return StepOutput(tokens, np.concatenate(lp), np.concatenate(ids), np.concatenate(top), prompt)


class Runner(Protocol):
    """The KV cache is paged (docs/design.md §10.3): ``num_pages`` pages of ``page_size`` tokens per layer, page 0
    the reserved null page (never allocated; idle rows and padding write there, nothing reads it unmasked).
    A *page table* is ``[pages_per_row]`` int32: entry ``i`` is the page holding positions
    ``i*page_size .. (i+1)*page_size - 1`` of that sequence, 0 where none is assigned. The host side
    (``engine.kv_pages``) owns allocation, sharing and the tables; the runner only reads and writes pages.
    """

    backend: object  # the LoRA backend object in use (kernels.backends; str() names it); "fake" for the fake runner
    page_size: int  # tokens per KV page
    num_pages: int  # pages in the pool, the null page 0 included

    def init_state(self) -> None:
        """Allocate the KV cache and the adapter slot pools (all slots zero)."""

    def warmup(self) -> None:
        """Compile every shape serving will use, so that serving never compiles."""

    def prepare(self, weights: LoraWeights) -> Any:
        """Host-side values for one slot from parsed adapter weights (loader thread; no slot-pool or cache
        access: the JAX runner computes DoRA's per-channel scales from the base weights here)."""

    def write_slot(self, index: int, values: Any) -> None:
        """Write ``prepare``'s values into slot ``index`` (between steps)."""

    def zero_slot(self, index: int) -> None:
        """Make slot ``index`` add exactly nothing."""

    def seed_history(
        self, row: int, prompt: list[int], generated: list[int], bias: list[tuple[int, float, int]]
    ) -> None:
        """Decode row ``row`` now holds a request that uses logits controls (``Sampling.controlled``): its
        history becomes ``prompt`` and ``generated`` (tokens seen; the generated ones counted) and its bias
        table ``bias`` (``Sampling.bias_entries``). Between steps, before the row's first prefill chunk."""

    def prefill(self, batch: Sequence[PrefillInput]) -> StepOutput:
        """For every sequence of ``batch`` (packed into as few calls as the runner's shapes allow):
        compute the keys/values of its ``tokens`` at positions ``start .. start+len-1`` under its adapter
        into the pages of its ``page_table``, attending to positions ``0 .. start-1`` already in those
        pages (a cached prefix); returns the token sampled after each sequence's last one, in order (with
        logprobs when some sequence's ``sampling.logprobs`` asks).
        A sequence may read pages an earlier sequence of the same batch writes (a prefix two prompts of
        one batch share): every sequence's keys/values of a layer are written before any attends."""

    def decode(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        sampling: list[SamplingRow | None],
    ) -> StepOutput:
        """One step for every row: ``tokens``/``positions``/``slots`` are ``[B]`` int32 (slot -1 = base or
        idle row, ``sampling[i]`` None for idle rows), ``page_tables`` is ``[B, pages_per_row]`` int32 (all
        0 for idle rows; the caller rewrites it after the call returns, so a runner that hands it to an
        asynchronous device copies it); row b writes its token's k/v at ``positions[b]`` and attends to
        ``0..positions[b]``.
        Returns the next token per row (``tokens`` ``[B]`` int32), with logprobs when some row asks.
        """

    def verify(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        drafts: np.ndarray,
        draft_lens: np.ndarray,
        sampling: list[SamplingRow | None],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Speculative decoding's verify step (``EngineConfig.speculative``; docs/speculative.md): as
        :meth:`decode`, but row b also feeds its ``draft_lens[b]`` drafts (``drafts`` ``[B, k]``) at the
        positions after ``positions[b]``, writing their k/v too (its pages hold them). Returns ``accepted``
        ``[B]`` (drafts kept) and ``tokens`` ``[B, k + 1]``, whose first ``accepted[b] + 1`` the row emits
        (``models.speculative.verify``'s rule). Rows with logits controls, a grammar or logprobs never come."""

    # The scheduler calls ``decode`` as its two halves below; ``chains`` says whether ``decode_start`` takes
    # ``follow`` (async decode, EngineConfig.async_decode)
    chains: bool

    def decode_start(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        sampling: list[SamplingRow | None],
        follow: Any = None,
    ) -> Any:
        """``decode``'s step, dispatched: returns a handle for :meth:`decode_finish`. ``follow``: the handle of
        the step before, not yet finished, whose drawn tokens are this step's ``tokens`` (every row: the batch
        is the same), read where they are (a device's output) instead of from ``tokens``."""

    def decode_finish(self, handle: Any) -> StepOutput:
        """The tokens (and logprobs) of a step :meth:`decode_start` dispatched, on the host."""
