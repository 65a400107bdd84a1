"""What a generation request is inside the worker, what it emits, and how it is validated."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc

from loraserve.common.errors import InvalidArgument
from loraserve.common.finish_reasons import FinishReason
from loraserve.common.limits import (
    INT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_PENALTY,
    MAX_PREDICTION_TOKENS,
    MAX_SPECULATIVE_TOKENS,
    MAX_STOP_TOKEN_IDS,
    REPETITION_PENALTY_RANGE,
    SPECULATIVE_METHODS,
    UINT32_MAX,
)
from loraserve.models.sizes import MAX_LOGPROBS

if TYPE_CHECKING:
    import numpy as np

    from loraserve.engine.speculative import DraftState


class Constraint(Protocol):
    """A structured output's state as the engine uses it (the worker's ``worker.grammar.TokenMatcher``): the
    bitmask of the tokens allowed next, advanced by each token drawn."""

    def mask(self) -> np.ndarray:
        """[ceil(V / 32)] int32: bit j of word i allows token 32 i + j."""

    def accept(self, token: int) -> bool:
        """Advance by the drawn ``token``; False if the grammar refuses it."""

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows no further token (only EOS)."""

    @property
    def error(self) -> str:
        """Why the grammar refused a token."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 0  # 0 = engine default
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = no logprobs; N = the token's logprob and the N most likely
    prompt_logprobs: int | None = None  # None = none; N = each prompt token's (after the first) and N more
    prompt_only: bool = False  # generate nothing: score the prompt (with prompt_logprobs) and finish
    # the logits controls (models.sampling has their semantics)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # stop tokens (stop_token_ids, EOS unless ignore_eos) are banned until this many
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    # speculative decoding (docs/speculative.md): "" = the server's --speculative, else "off" or "ngram"; the
    # tokens a row may propose per step, 0 = the server's --num-speculative-tokens (at most that: its verify
    # step's shape). A server that does not speculate decodes such a request plainly.
    speculative: str = ""
    num_speculative_tokens: int = 0

    @property
    def controlled(self) -> bool:
        """Whether any logits control is on: the row's history lives on the device (``RowHistory``)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
        )

    def bias_entries(self, eos_ids: tuple[int, ...] | frozenset[int]) -> list[tuple[int, float, int]]:
        """The row's bias table: ``(token id, value, applies while step < this)``: logit_bias for every
        step, then -inf on the stop tokens (``stop_token_ids``, EOS unless ``ignore_eos``) for the first
        ``min_tokens`` steps."""
        entries = [(t, v, INT32_MAX) for t, v in self.logit_bias]
        if self.min_tokens:
            stops = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))
            entries += [(t, -math.inf, self.min_tokens) for t in sorted(stops)]
        return entries

    def validate(self, vocab_size: int) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(f"temperature must be finite and >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 <= self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= UINT32_MAX:
            raise InvalidArgument(f"top_k must be in [0, {UINT32_MAX}], got {self.top_k}")
        if not 0 <= self.max_tokens <= UINT32_MAX:
            raise InvalidArgument(f"max_tokens must be in [0, {UINT32_MAX}], got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidArgument(f"seed must fit in 64 bits, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
            )
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"stop_token_ids {bad[:5]} are outside the vocabulary")
        self._validate_controls(vocab_size)
        if self.speculative not in ("", *SPECULATIVE_METHODS):
            raise InvalidArgument(
                f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} (or empty: the server's),"
                f" got {self.speculative[:32]!r}"
            )
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidArgument(
                f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] (0: the server's),"
                f" got {self.num_speculative_tokens}"
            )

    def _validate_controls(self, vocab_size: int) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > MAX_PENALTY:
                raise InvalidArgument(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not (math.isfinite(self.repetition_penalty) and lo <= self.repetition_penalty <= hi):
            raise InvalidArgument(
                f"repetition_penalty must be in [{lo}, {hi}], got {self.repetition_penalty}"
            )
        if not 0 <= self.min_tokens <= UINT32_MAX:
            raise InvalidArgument(f"min_tokens must be in [0, {UINT32_MAX}], got {self.min_tokens}")
        if self.max_tokens and self.min_tokens > self.max_tokens:
            raise InvalidArgument(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        ids = [t for t, _ in self.logit_bias]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(
                f"logit_bias token ids {bad[:5]} are outside the vocabulary of {vocab_size}"
            )
        if len(set(ids)) != len(ids):
            raise InvalidArgument("logit_bias names a token id twice")
        off = [v for _, v in self.logit_bias if not (math.isfinite(v) and abs(v) <= MAX_LOGIT_BIAS_VALUE)]
        if off:
            raise InvalidArgument(
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], got {off[0]}"
            )

    def resolved_seed(self) -> int:
        return self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little")


@dataclass(frozen=True)
class Started:
    """The request was admitted; ``adapter`` is the resolved key actually served ("" for the base model).
    ``prompt_logprobs`` (when the request asked): one entry per prompt token after the first, the token's
    log-probability given the ones before it and the ``Sampling.prompt_logprobs`` most likely there."""

    adapter: str
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the raw distribution and the ``len(top_ids)`` most
    likely tokens with theirs, most likely first (the request's ``Sampling.logprobs`` of them)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def cut(self, n: int) -> TokenLogprobs:
        """The same with only the ``n`` most likely alternatives."""
        return TokenLogprobs(self.logprob, self.top_ids[:n], self.top_logprobs[:n])


@dataclass(frozen=True)
class Token:
    token_id: int
    logprobs: TokenLogprobs | None = None  # set when the request asked for logprobs


@dataclass(frozen=True)
class Finished:
    """The request ended; ``token_id`` is the last token when it came with the finish (else None), with
    its ``logprobs`` when the request asked for them."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    token_id: int | None = None
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class Failed:
    """The request ended with an error; ``code`` is the gRPC status the stream ends with."""

    code: grpc.StatusCode
    message: str


Event = Started | Token | Finished | Failed


@dataclass(eq=False)
class EngineRequest:
    """One request as the engine thread sees it. ``sink`` is called from the engine thread."""

    request_id: str
    adapter: str  # "" | "name" | "name@3"
    prompt: list[int]
    sampling: Sampling
    sink: Callable[[Event], None]
    deadline: float | None = None  # absolute time.monotonic() seconds; past it the request fails
    # engine-thread state
    key: str = ""
    slot: int = -1
    row: int = -1
    seed: int = 0
    max_new_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    prompt_scores: list[TokenLogprobs] | None = None  # while its prompt is scored (Sampling.prompt_logprobs)
    grammar: Constraint | None = None  # structured outputs: what the next token may be (worker.grammar)
    # speculative decoding: the row's drafting (engine.speculative.DraftState; None: it does not draft), and
    # its drafts proposed and kept so far (read by the server for the request's usage when it ends)
    drafting: DraftState | None = None
    prediction: list[int] | None = None  # the caller's predicted output: drafts come from it (predicted())
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    done: bool = False

    def emit(self, event: Event) -> None:
        if isinstance(event, Finished | Failed):
            if self.done:
                return
            self.done = True
        try:
            self.sink(event)
        except Exception:  # a broken consumer must never take the engine thread down
            logging.getLogger("loraserve.engine.engine").exception(
                "sink of request %s failed", self.request_id
            )


@dataclass(frozen=True)
class SamplingRow:
    """One row's sampling inputs as the runner takes them: parameters, seed, tokens drawn so far, and
    whether the row wants logprobs."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    step: int = 0
    logprobs: bool = False
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    controlled: bool = False  # the row's logits controls read its RowHistory row (the decode row)
    mask: np.ndarray | None = None  # [ceil(V / 32)] int32: the tokens its grammar allows (structured outputs)

    @classmethod
    def of(cls, req: EngineRequest, drawn: bool = True, ahead: int = 0) -> SamplingRow:
        """``req``'s row; ``drawn`` False for a prefill chunk whose sample is dropped (not its prompt's
        last): no grammar mask is computed for it. ``ahead``: tokens drawn for it that are not yet in
        ``req.generated`` (async decode: the step before, still on the device)."""
        s = req.sampling
        top_k = min(
            s.top_k, INT32_MAX
        )  # a uint32 on the wire, int32 on the device: past the vocabulary = off
        return cls(
            s.temperature,
            top_k,
            s.top_p,
            req.seed,
            len(req.generated) + ahead,
            s.logprobs is not None,
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty,
            s.controlled,
            None if req.grammar is None or not drawn else req.grammar.mask(),
        )


def validate_prediction(prediction: list[int], vocab_size: int) -> None:
    """A request's predicted output (speculative decoding): at most MAX_PREDICTION_TOKENS ids, each in the
    vocabulary."""
    if len(prediction) > MAX_PREDICTION_TOKENS:
        raise InvalidArgument(f"prediction has {len(prediction)} tokens; at most {MAX_PREDICTION_TOKENS}")
    bad = [t for t in prediction if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"prediction token ids {bad[:5]} are outside the vocabulary of {vocab_size}")


def validate_prompt(prompt: list[int], vocab_size: int, max_seq_len: int) -> None:
    if not prompt:
        raise InvalidArgument("prompt is empty")
    if len(prompt) >= max_seq_len:
        raise InvalidArgument(
            f"prompt has {len(prompt)} tokens; this worker's context is {max_seq_len} (prompt + at least 1 new token)",
        )
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"prompt token ids {bad[:5]} are outside the vocabulary of {vocab_size}")
