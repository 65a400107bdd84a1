"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regex, a choice of strings,
a Lark or GBNF grammar) compiled by llguidance into a per-request matcher, whose token bitmask the sampler
applies to the request's row (``models.sampling.apply_mask``).

The worker builds one :class:`Grammars` per tokenizer at start-up (llguidance's tokenizer over the model's
vocabulary, ~1 s). The servicer compiles a request's constraint off the event loop (``Grammars.matcher``:
INVALID_ARGUMENT with llguidance's message for a constraint that does not compile); the engine thread asks
the matcher for the next token's bitmask before each step of the row (``TokenMatcher.mask``) and feeds it
each token drawn (``TokenMatcher.accept``). A matcher that can take no more tokens ends the request with
finish reason ``stop``; one whose grammar allows ending may draw EOS.

Hostile grammars are bounded: the constraint's text by ``common.limits.MAX_CONSTRAINT_CHARS`` at every door,
its compiled size, lexer states and per-step work by :data:`LIMITS` (llguidance's parser limits), so one
request can neither take the engine thread for long nor hold unbounded memory.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from loraserve.common.errors import InvalidArgument
from loraserve.protos.v1 import inference_pb2 as pb

# JSON is generated compactly (no whitespace between tokens): a model cannot spend its tokens on spaces
JSON_OPTIONS = {"whitespace_flexible": False}


def _limits() -> Any:
    from llguidance import LLParserLimits

    # per step: ~3.5 ms of lexer work and ~1 ms of parser items at most; ~20 MB of lexer states per request
    return LLParserLimits(
        step_lexer_fuel=50_000,
        step_max_items=20_000,
        max_lexer_states=10_000,
        max_grammar_size=50_000,
        initial_lexer_fuel=1_000_000,
    )


def grammar_text(spec: pb.StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (not yet compiled); INVALID_ARGUMENT for what is not one."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    kind = spec.WhichOneof("kind")
    if kind == "json_schema":
        try:
            schema = json.loads(spec.json_schema)
        except ValueError as exc:
            raise InvalidArgument(f"json_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidArgument("json_schema must be a JSON object (a JSON Schema)")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        if not spec.choice.choices:
            raise InvalidArgument("choice needs at least one string")
        alternatives = " | ".join(json.dumps(c) for c in spec.choice.choices)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if kind == "grammar":
        text = spec.grammar
        if "::=" in text:  # GBNF (llama.cpp's, vLLM's guided_grammar form): llguidance reads it as Lark
            try:
                text = gbnf_to_lark(text)
            except Exception as exc:
                raise InvalidArgument(f"grammar is not valid GBNF: {str(exc)[:300]}") from None
        return LLMatcher.grammar_from_lark(text)
    raise InvalidArgument("structured output names no constraint")


class TokenMatcher:
    """One request's grammar state: the bitmask of the tokens it allows next, advanced by each token."""

    def __init__(self, matcher: Any, words: int) -> None:
        self._matcher = matcher
        self._buffer = np.zeros((1, words), np.int32)

    def mask(self) -> np.ndarray:
        """[ceil(V / 32)] int32: bit j of word i allows token 32 i + j."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._buffer, 0)
        return self._buffer[0].copy()

    def accept(self, token: int) -> bool:
        """Advance by the drawn ``token``; False if the grammar refuses it (the matcher is then in error)."""
        return bool(self._matcher.consume_token(token))

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows no further token (only EOS)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


class Grammars:
    """Compiles constraints against one tokenizer over the model's ``vocab_size`` tokens."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        eos = list(eos_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.limits = _limits()

    def matcher(self, spec: pb.StructuredOutput) -> TokenMatcher:
        """A fresh matcher for ``spec`` (seconds at most for a large grammar: call off the event loop);
        INVALID_ARGUMENT with llguidance's message when it does not compile."""
        from llguidance import LLMatcher

        grammar = grammar_text(spec)
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise InvalidArgument(f"the structured output does not compile: {matcher.get_error()[:500]}")
        return TokenMatcher(matcher, -(-self.vocab_size // 32))
