"""Drafters for speculative decoding: what a row proposes to verify in one step (docs/speculative.md).

A decode step reads every weight to produce one token per row, so where the step is bound by memory (small
and medium batches; on a TPU almost any batch) checking several proposed tokens costs about what one token
costs. A *drafter* proposes up to ``k`` tokens per row; the model's verify step (``models.speculative``)
keeps the longest prefix the target model agrees with, plus one token of its own.

:func:`predicted` drafts from a request's *prediction* (OpenAI's predicted outputs: the text the caller
expects the answer to be, e.g. the file a code edit rewrites): what follows, in the prediction, the place the
output has reached.

:class:`NgramDrafter` is prompt lookup (no model): the row's last ``n`` tokens are searched for earlier in its
prompt and output, and the tokens that followed the most recent earlier match are proposed. Answers that quote
their prompt (summaries, code edits, extraction) accept most of them; elsewhere it proposes nothing or little.
Its cost is bounded by :data:`SEARCH_WINDOW`, whatever a tenant's prompt holds.

Whether to speculate at all is measured, not assumed. Each row keeps a :class:`DraftState`: how many tokens it
may propose (``k``, adapted to what it keeps) and an estimate of the chance that a draft is kept, and a row
whose drafts are all rejected rests for a growing number of steps (it is not even searched). :class:`StepCosts`
times the engine's decode and verify steps and chooses a verify step only when the drafts' expected kept tokens
pay for what a verify step costs beyond a decode step (:meth:`StepCosts.worth`).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loraserve.common.limits import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "PREDICTED_RATE",
    "PRIOR_RATE",
    "SEARCH_WINDOW",
    "SPECULATIVE_METHODS",
    "DraftState",
    "NgramDrafter",
    "StepCosts",
    "predicted",
]

SEARCH_WINDOW = 4096  # the last tokens of a row an n-gram is searched in: bounded host work per step
PRIOR_RATE = 0.5  # a new row's chance that a draft is kept, before any of its drafts is verified
PREDICTED_RATE = 0.9  # ... when its drafts come from the caller's prediction (meant to be the answer)
RATE_WEIGHT = 0.3  # the weight of a verify step's outcome in a row's estimate (an exponential average)
ADAPTER_RATES = 1024  # adapters whose n-gram drafts' kept share an engine remembers (the least recent go)
MAX_REST = 64  # the longest rest (steps without drafting) of a row whose drafts keep being rejected
COST_WINDOW = 5  # the steps of each kind whose times the step costs keep (their lower median counts)
# the most decode steps an engine runs between two looks for drafts that found none to verify
MAX_TRY_REST = 16
PROBE_SHARE = 0.02  # the share of decode time verify steps the rule did not choose may cost (to re-measure)


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt-lookup drafting. ``max_ngram`` down to ``min_ngram``: the longest suffix of the row that occurs
    earlier wins (a longer match predicts better); among its occurrences the most recent."""

    max_ngram: int = 3
    min_ngram: int = 1
    window: int = SEARCH_WINDOW

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")
        if self.window < self.max_ngram + 1:
            raise ValueError(f"window {self.window} is shorter than an n-gram and its next token")

    def propose(self, tokens: Sequence[int] | np.ndarray, k: int) -> np.ndarray:
        """Up to ``k`` tokens to follow ``tokens`` (the row's prompt and output so far), int32; empty when no
        suffix of ``max_ngram`` to ``min_ngram`` tokens occurs earlier in the last :attr:`window` tokens.

        *Semantics:* for the largest n with a match, the tokens after the latest earlier occurrence of the
        last n tokens, at most k of them and never past the end of ``tokens``.
        """
        if k <= 0:
            return np.zeros(0, np.int32)
        seq = np.asarray(tokens, np.int64)[-self.window :]
        size = seq.shape[0]
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            suffix = seq[size - n :]
            # windows of n tokens starting at 0 .. size - n - 1 (the suffix itself excluded)
            starts = np.lib.stride_tricks.sliding_window_view(seq[: size - 1], n)
            hits = np.flatnonzero((starts == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the token after the latest earlier occurrence
                return seq[start : start + k].astype(np.int32)
        return np.zeros(0, np.int32)


def predicted(
    prediction: Sequence[int] | np.ndarray, generated: Sequence[int], k: int, max_ngram: int = 3
) -> np.ndarray:
    """Up to ``k`` tokens of ``prediction`` to follow ``generated`` (the row's output so far), int32.

    *Semantics:* nothing generated yet: the prediction's first k tokens. Else the longest suffix of
    ``generated`` (``max_ngram`` tokens down to 1) that occurs in the prediction, at the occurrence that ends
    nearest to ``len(generated)`` (where an output that copies the prediction, give or take a few edited
    tokens, has reached), and the tokens after it; empty without an occurrence. The work is bounded by the
    prediction's length (at most ``MAX_PREDICTION_TOKENS``)."""
    if k <= 0:
        return np.zeros(0, np.int32)
    pred = np.asarray(prediction, np.int64)
    if not len(generated):
        return pred[:k].astype(np.int32)
    tail = np.asarray(generated[-max_ngram:], np.int64)
    for n in range(min(max_ngram, len(tail), len(pred)), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(pred, n)
        ends = np.flatnonzero((windows == tail[len(tail) - n :]).all(axis=1)) + n  # the index after each
        if ends.size:
            end = int(ends[np.argmin(np.abs(ends - len(generated)))])
            return pred[end : end + k].astype(np.int32)
    return np.zeros(0, np.int32)


@dataclass
class DraftState:
    """One row's drafting. ``limit``: the most tokens it may propose (its request's k, else the server's);
    ``k``: what it proposes now; ``rate``: its estimated chance that a draft token is kept (an exponential
    average of kept ÷ proposed over its verify steps); ``rest``: steps left before it drafts again, after a
    verify step kept none of its drafts (1, 2, 4 ... up to :data:`MAX_REST` steps in a row of those)."""

    limit: int
    k: int = 0
    rate: float = PRIOR_RATE
    rest: int = 0
    _rests: int = 0

    def __post_init__(self) -> None:
        self.k = self.k or self.limit

    def wanted(self) -> int:
        """How many tokens to ask the drafter for this step (0 while resting: a rest step counts down)."""
        if self.rest > 0:
            self.rest -= 1
            return 0
        return self.k

    def expected(self, proposed: int) -> float:
        """Expected kept tokens of ``proposed`` drafts: the first i are kept with chance rate^i."""
        r = min(max(self.rate, 0.0), 1.0)
        return sum(r**i for i in range(1, proposed + 1))

    def update(self, proposed: int, kept: int) -> None:
        """A verify step kept ``kept`` of the row's ``proposed`` drafts (proposed > 0): every draft kept
        grows k by one (up to ``limit``); some kept sets k to kept + 1; none halves k and starts a rest."""
        self.rate += RATE_WEIGHT * (kept / proposed - self.rate)
        if kept == proposed:
            self.k, self._rests = min(self.k + 1, self.limit), 0
        elif kept:
            self.k, self._rests = min(kept + 1, self.limit), 0
        else:
            self.k = max(1, self.k // 2)
            self._rests = min(max(1, 2 * self._rests), MAX_REST)
            self.rest = self._rests


class StepCosts:
    """The engine's decode and verify steps' seconds, and the rule that picks a verify step.

    A decode step gives every decoding row one token; a verify step gives each row one token plus the drafts
    it keeps, and costs ``ratio`` = verify ÷ decode seconds (about 1 where a step is bound by reading the
    weights; more where it is bound by compute: large batches on a CPU). So a verify step pays when the rows'
    expected kept drafts exceed ``rows × (ratio − 1)``. Each kind's time is the lower median of its last
    :data:`COST_WINDOW` steps, so one slow step (a compilation, a pause of the host) does not move it; until a
    decode step and two verify steps have been timed the rule runs them (a decode step first). The rows'
    estimates change only when they verify, so when the rule says no for long, a verify step runs anyway once
    the decode steps since the last one have taken ``(ratio − 1) ÷ PROBE_SHARE`` steps: such probes cost at
    most :data:`PROBE_SHARE` of the decode time."""

    def __init__(self) -> None:
        self._seconds: dict[str, deque[float]] = {k: deque(maxlen=COST_WINDOW) for k in ("decode", "verify")}
        self.since_verify = 0  # decode steps since the last verify step
        self.probes = 0  # verify steps the rule ran to re-measure

    def observe(self, kind: str, seconds: float) -> None:
        """A step of ``kind`` ("decode" or "verify") took ``seconds``."""
        self._seconds[kind].append(seconds)
        self.since_verify = 0 if kind == "verify" else self.since_verify + 1

    def seconds(self, kind: str) -> float | None:
        """The time of a ``kind`` step: the lower median of the last ones timed (None before any)."""
        times = self._seconds[kind]
        return statistics.median_low(times) if times else None

    @property
    def ratio(self) -> float | None:
        """Verify ÷ decode seconds, once a decode step and two verify steps have been timed."""
        decode, verify = self.seconds("decode"), self.seconds("verify")
        if decode is None or verify is None or len(self._seconds["verify"]) < 2 or decode <= 0:
            return None
        return verify / decode

    def worth(self, expected_kept: float, rows: int) -> bool:
        """Whether a verify step pays for ``rows`` decoding rows whose drafts' expected kept tokens sum to
        ``expected_kept`` (the class docstring's rule)."""
        if expected_kept <= 0 or not self._seconds["decode"]:
            return False
        ratio = self.ratio
        if ratio is None:
            return True  # time the verify step (twice: the first may have paid for more than itself)
        extra = max(ratio - 1.0, 0.0)
        if expected_kept > rows * extra:
            return True
        if self.since_verify * PROBE_SHARE >= extra:
            self.probes += 1
            return True
        return False


class AdapterRates:
    """Per adapter, the share of n-gram drafts its rows' verify steps kept (an exponential average, weight
    :data:`RATE_WEIGHT`): a new row of that adapter starts from it instead of :data:`PRIOR_RATE`, so an adapter
    whose answers quote their prompts drafts from its first step, and one whose drafts fail waits. At most
    :data:`ADAPTER_RATES` adapters, the least recently updated forgotten first."""

    def __init__(self, limit: int = ADAPTER_RATES) -> None:
        self.limit = limit
        self._rates: OrderedDict[str, float] = OrderedDict()

    def get(self, adapter: str) -> float:
        return self._rates.get(adapter, PRIOR_RATE)

    def update(self, adapter: str, proposed: int, kept: int) -> None:
        old = self._rates.pop(adapter, PRIOR_RATE)
        self._rates[adapter] = old + RATE_WEIGHT * (kept / proposed - old)
        while len(self._rates) > self.limit:
            self._rates.popitem(last=False)

    def __len__(self) -> int:
        return len(self._rates)
