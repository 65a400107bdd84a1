"""A runner without a model (no JAX): arithmetic tokens, so scheduler tests assert exact sequences.

Rule: the prefill token and every decode token are ``(last + slot + 2) % vocab_size``, where ``last`` is
the row's previous token (the prompt's last token for prefill) and ``slot`` is the row's adapter slot,
-1 for the base model. So prompt ``[5]`` on the base model gives 6, 7, 8, ...; on slot 1 it gives
8, 11, 14, .... Sampling parameters are ignored. Every call is recorded for assertions.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from loraserve.adapters.peft import LoraWeights
from loraserve.worker.requests import SamplingRow


def next_token(last: int, slot: int, vocab_size: int) -> int:
    return (last + slot + 2) % vocab_size


@dataclass
class FakeRunner:
    """``Runner`` for tests. ``slot_contents[i]`` is the sha256 of the adapter written to slot i ("" = zero).

    ``gate``, when set, is waited on before every decode step, so a test can hold the engine mid-request.
    """

    vocab_size: int
    max_loras: int
    backend: str = "fake"
    gate: threading.Event | None = None
    slot_contents: list[str] = field(default_factory=list)
    writes: list[tuple[int, str]] = field(default_factory=list)  # (slot, sha256) per write_slot
    zeroed: list[int] = field(default_factory=list)
    prefills: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)  # (row, slot, prompt)
    decode_steps: int = 0
    warmed_up: bool = False

    def __post_init__(self) -> None:
        self.init_state()

    def init_state(self) -> None:
        self.slot_contents = [""] * self.max_loras

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

    def prefill(self, prompt: list[int], slot: int, row: int, sampling: SamplingRow) -> int:
        self.prefills.append((row, slot, tuple(prompt)))
        return next_token(prompt[-1], slot, self.vocab_size)

    def decode(
        self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, sampling: list[SamplingRow | None]
    ) -> np.ndarray:
        if self.gate is not None:
            self.gate.wait()
        self.decode_steps += 1
        out = np.zeros_like(tokens)
        for i, row in enumerate(sampling):
            if row is not None:
                out[i] = next_token(int(tokens[i]), int(slots[i]), self.vocab_size)
        return out
