"""Drafters for speculative decoding: what a row proposes to verify in one step (docs/speculative.md).

A decode step reads every weight to produce one token per row, so where the step is bound by memory (small
and medium batches; on a TPU almost any batch) checking several proposed tokens costs about what one token
costs. A *drafter* proposes up to ``k`` tokens per row; the model's verify step (``models.speculative``)
keeps the longest prefix the target model agrees with, plus one token of its own.

:class:`NgramDrafter` is prompt lookup (no model): the row's last ``n`` tokens are searched for earlier in its
prompt and output, and the tokens that followed the most recent earlier match are proposed. Answers that quote
their prompt (summaries, code edits, extraction) accept most of them; elsewhere it proposes nothing or little.
Its cost is bounded by :data:`SEARCH_WINDOW`, whatever a tenant's prompt holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loraserve.engine.config import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

__all__ = ["MAX_SPECULATIVE_TOKENS", "SEARCH_WINDOW", "SPECULATIVE_METHODS", "NgramDrafter"]

SEARCH_WINDOW = 4096  # the last tokens of a row an n-gram is searched in: bounded host work per step


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
