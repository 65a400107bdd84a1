"""The device side of the engine as a protocol: what the host-side scheduler asks of a model runner.

``worker.jax_runner.JaxRunner`` is the real one (jitted, donated, never recompiling after ``warmup``);
``worker.fake_runner.FakeRunner`` makes arithmetic tokens so the scheduler can be tested in milliseconds.
Every method is called from the engine thread, except ``prepare`` (loader threads).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from loraserve.adapters.peft import LoraWeights
from loraserve.worker.requests import SamplingRow


class Runner(Protocol):
    backend: object  # the LoRA backend object in use (kernels.backends; str() names it); "fake" for the fake runner

    def init_state(self) -> None:
        """Allocate the KV cache and the adapter slot pools (all slots zero)."""

    def warmup(self) -> None:
        """Compile every shape serving will use, so that serving never compiles."""

    def prepare(self, weights: LoraWeights) -> Any:
        """Host-side values for one slot from parsed adapter weights (loader thread; no device work)."""

    def write_slot(self, index: int, values: Any) -> None:
        """Write ``prepare``'s values into slot ``index`` (between steps)."""

    def zero_slot(self, index: int) -> None:
        """Make slot ``index`` add exactly nothing."""

    def prefill(self, prompt: list[int], slot: int, row: int, sampling: SamplingRow) -> int:
        """Fill cache row ``row`` with ``prompt`` under adapter ``slot`` (-1 = base); returns the first token."""

    def decode(
        self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, sampling: list[SamplingRow | None]
    ) -> np.ndarray:
        """One step for every row: ``tokens``/``positions``/``slots`` are ``[B]`` int32 (slot -1 = base or
        idle row, ``sampling[i]`` None for idle rows); returns the next token per row, ``[B]`` int32.
        """
