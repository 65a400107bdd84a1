"""A runner without a model (no JAX): arithmetic tokens, so scheduler tests assert exact sequences.

Rule: the prefill token and every decode token are ``(last + slot + 2) % vocab_size``, where ``last`` is
the row's previous token (the prompt's last token for prefill) and ``slot`` is the row's adapter slot,
-1 for the base model. So prompt ``[5]`` on the base model gives 6, 7, 8, ...; on slot 1 it gives
8, 11, 14, .... Sampling parameters and logits controls are ignored (``seed_history`` calls are recorded). Every call is recorded for assertions. A row whose
``SamplingRow.logprobs`` is set gets ``fake_logprobs``: its token ranked first, then the next ids in order,
the token at rank k with logprob ``-(k + 1) / 4``.

The KV cache is simulated so that wrong page reuse fails loudly: ``cells[(page, offset)]`` is the
``(content, token)`` last written there, content being the sha256 of the adapter in the writing slot
(``"base"`` for slot -1). ``prefill`` asserts that every position before ``start`` is in a real page
(never the null page 0) and was written under the same content, records the whole context it attends to
(``contexts``: those cached tokens + its own), then writes its tokens; ``decode`` writes each row's token at
its position and asserts the same of every position the row attends to. A failed check is an
``AssertionError`` raised into the scheduler, i.e. into the test.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

import numpy as np

from loraserve.adapters.peft import LoraWeights
from loraserve.engine.config import EngineConfig
from loraserve.engine.request import SamplingRow, TokenLogprobs
from loraserve.engine.runner import PrefillInput, StepOutput
from loraserve.models.sizes import MAX_LOGPROBS

# a default EngineConfig's pool, read off the class: building one would import the kernels (JAX)
_PAGE = EngineConfig.kv_page_size
_PAGES = EngineConfig.max_batch_size * -(-EngineConfig.max_seq_len // _PAGE) + 1


def next_token(last: int, slot: int, vocab_size: int) -> int:
    return (last + slot + 2) % vocab_size


def fake_logprobs(token: int, vocab_size: int) -> tuple[list[int], list[float]]:
    """The top ids and logprobs [K] the fake runner reports for ``token``: ``token + k`` at rank k
    (mod vocab) with logprob ``-(k + 1) / 4``, so the token's own logprob is -0.25."""
    k = min(MAX_LOGPROBS, vocab_size)
    return [(token + i) % vocab_size for i in range(k)], [-(i + 1) / 4 for i in range(k)]


def _output(tokens: list[int], rows: list[SamplingRow | None], vocab_size: int) -> StepOutput:
    out = np.array(tokens, np.int32)
    if not any(r is not None and r.logprobs for r in rows):
        return StepOutput(out)
    k = min(MAX_LOGPROBS, vocab_size)
    lp, ids, top = (
        np.zeros(len(rows), np.float32),
        np.zeros((len(rows), k), np.int32),
        np.zeros((len(rows), k), np.float32),
    )
    for i, row in enumerate(rows):
        if row is not None and row.logprobs:
            ids[i], top[i] = fake_logprobs(int(out[i]), vocab_size)
            lp[i] = top[i, 0]
    return StepOutput(out, lp, ids, top)


@dataclass
class FakeRunner:
    """``Runner`` for tests. ``slot_contents[i]`` is the sha256 of the adapter written to slot i ("" = zero).

    ``gate``, when set, is waited on before every decode step, so a test can hold the engine mid-request.
    ``page_size``/``num_pages`` default to those of a default ``EngineConfig``; ``for_config`` takes a
    config's.
    """

    vocab_size: int
    max_loras: int
    page_size: int = _PAGE
    num_pages: int = _PAGES
    backend: str = "fake"
    gate: threading.Event | None = None
    slot_contents: list[str] = field(default_factory=list)
    writes: list[tuple[int, str]] = field(default_factory=list)  # (slot, sha256) per write_slot
    zeroed: list[int] = field(default_factory=list)
    # (row, prompt, generated, bias entries) per seed_history
    histories: list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[tuple[int, float, int], ...]]] = field(
        default_factory=list
    )
    # (start, slot, tokens, page table) per prefill; the table is a copy, trailing null entries dropped
    prefills: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    prefill_batches: list[int] = field(default_factory=list)  # sequences per prefill call (packing)
    contexts: list[tuple[int, ...]] = field(default_factory=list)  # per prefill: cached tokens + its own
    cells: dict[tuple[int, int], tuple[str, int]] = field(default_factory=dict)
    decode_steps: int = 0
    verify_steps: int = 0  # speculative decoding's verify steps (verify)
    warmed_up: bool = False

    @classmethod
    def for_config(cls, vocab_size: int, config: EngineConfig, **kw) -> FakeRunner:
        """A fake runner with ``config``'s slots and KV pool (``kv_cache_bytes`` counted as 1 byte a page)."""
        return cls(vocab_size, config.max_loras, config.kv_page_size, config.num_kv_pages(1), **kw)

    def __post_init__(self) -> None:
        self.init_state()

    def init_state(self) -> None:
        self.slot_contents = [""] * self.max_loras
        self.cells = {}

    def warmup(self) -> None:
        self.warmed_up = True

    def prepare(self, weights: LoraWeights) -> str:
        return weights.sha256

    def write_slot(self, index: int, values: str) -> None:
        self.writes.append((index, values))
        self.slot_contents[index] = values

    def zero_slot(self, index: int) -> None:
        self.zeroed.append(index)
        self.slot_contents[index] = ""

    def seed_history(
        self, row: int, prompt: list[int], generated: list[int], bias: list[tuple[int, float, int]]
    ) -> None:
        self.histories.append((row, tuple(prompt), tuple(generated), tuple(bias)))

    def prefill(self, batch: list[PrefillInput]) -> StepOutput:
        self.prefill_batches.append(len(batch))
        tokens = [self.prefill_one(p.tokens, p.start, p.slot, p.page_table, p.sampling) for p in batch]
        out = _output(tokens, [p.sampling for p in batch], self.vocab_size)
        if all(p.targets is None for p in batch):
            return out
        scored = tuple(None if p.targets is None else self._scores(p.targets) for p in batch)
        return dataclasses.replace(out, prompt=scored)

    def _scores(self, targets: list[int]) -> tuple[TokenLogprobs, ...] | None:
        """Each target's ``fake_logprobs``: ranked first at -0.25, the next ids after it."""
        out = []
        for target in (t for t in targets if t >= 0):
            ids, lps = fake_logprobs(target, self.vocab_size)
            out.append(TokenLogprobs(lps[0], tuple(ids), tuple(lps)))
        return tuple(out) or None

    def prefill_one(
        self, tokens: list[int], start: int, slot: int, page_table: np.ndarray, sampling: SamplingRow
    ) -> int:
        table = [int(p) for p in page_table]
        content = self._content(slot)
        cached = tuple(self._read(table, q, content)[1] for q in range(start))
        used = len(table)
        while used and table[used - 1] == 0:
            used -= 1
        self.prefills.append((start, slot, tuple(tokens), tuple(table[:used])))
        self.contexts.append(cached + tuple(tokens))
        for q, token in enumerate(tokens, start):
            self._write(table, q, content, token)
        return next_token(tokens[-1], slot, self.vocab_size)

    def decode(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        sampling: list[SamplingRow | None],
    ) -> StepOutput:
        if self.gate is not None:
            self.gate.wait()
        self.decode_steps += 1
        out = np.zeros_like(tokens)
        for i, row in enumerate(sampling):
            if row is None:
                assert not page_tables[i].any(), f"idle row {i} has pages {page_tables[i].tolist()}"
                continue
            table, slot, pos = [int(p) for p in page_tables[i]], int(slots[i]), int(positions[i])
            content = self._content(slot)
            self._write(table, pos, content, int(tokens[i]))
            for q in range(pos):
                self._read(table, q, content)
            out[i] = next_token(int(tokens[i]), slot, self.vocab_size)
        return _output(out.tolist(), sampling, self.vocab_size)

    chains = True  # async decode: the step runs at once; follow's tokens are this step's (host) inputs

    def decode_start(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        sampling: list[SamplingRow | None],
        follow: StepOutput | None = None,
    ) -> StepOutput:
        return self.decode(
            tokens if follow is None else follow.tokens, positions, slots, page_tables, sampling
        )

    def decode_finish(self, handle: StepOutput) -> StepOutput:
        return handle

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
        """Every row's last token and drafts written at their positions (the pages must hold them) after its
        context is read; the drafts equal to :func:`next_token`'s chain are kept (its greedy rule)."""
        if self.gate is not None:
            self.gate.wait()
        self.verify_steps += 1
        b, k = drafts.shape
        accepted, out = np.zeros(b, np.int32), np.zeros((b, k + 1), np.int32)
        for i, row in enumerate(sampling):
            if row is None:
                assert not page_tables[i].any(), f"idle row {i} has pages {page_tables[i].tolist()}"
                continue
            table, slot, pos = [int(p) for p in page_tables[i]], int(slots[i]), int(positions[i])
            content, n = self._content(slot), int(draft_lens[i])
            for q in range(pos):
                self._read(table, q, content)
            inputs = [int(tokens[i]), *drafts[i, :n].tolist()]
            for j, token in enumerate(inputs):
                self._write(table, pos + j, content, token)
            for j, token in enumerate(inputs):
                out[i, j] = next_token(token, slot, self.vocab_size)
                if j == n or out[i, j] != inputs[j + 1]:
                    break
                accepted[i] += 1
        return accepted, out

    # ----------------------------------------------------------------- the simulated cache
    def _content(self, slot: int) -> str:
        return "base" if slot < 0 else self.slot_contents[slot]

    def _cell(self, table: list[int], q: int) -> tuple[int, int]:
        assert q // self.page_size < len(table), f"position {q} is past the page table"
        page = table[q // self.page_size]
        assert 0 < page < self.num_pages, f"position {q} is in page {page}, not a real page"
        return page, q % self.page_size

    def _read(self, table: list[int], q: int, content: str) -> tuple[str, int]:
        cell = self.cells.get(self._cell(table, q))
        assert cell is not None, f"position {q} (page {table[q // self.page_size]}) was never written"
        assert cell[0] == content, f"position {q} holds KV of {cell[0]!r}, attended under {content!r}"
        return cell

    def _write(self, table: list[int], q: int, content: str, token: int) -> None:
        self.cells[self._cell(table, q)] = (content, token)
