"""The device side of the engine as a protocol: what the host-side scheduler asks of a model runner.

``worker.jax_runner.JaxRunner`` is the real one (jitted, donated, never recompiling after ``warmup``);
``worker.fake_runner.FakeRunner`` makes arithmetic tokens so the scheduler can be tested in milliseconds.
Every method is called from the engine thread, except ``prepare`` (loader threads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from loraserve.adapters.peft import LoraWeights
from loraserve.worker.requests import SamplingRow


@dataclass(frozen=True)
class PrefillInput:
    """One sequence of a packed prefill: its new ``tokens`` at positions ``start ..`` under adapter
    ``slot`` (-1 = base), its ``page_table`` (``[pages_per_row]`` int32) and sampling row."""

    tokens: list[int]
    start: int
    slot: int
    page_table: np.ndarray
    sampling: SamplingRow


class Runner(Protocol):
    """The KV cache is paged (DESIGN.md §10.3): ``num_pages`` pages of ``page_size`` tokens per layer, page 0
    the reserved null page (never allocated; idle rows and padding write there, nothing reads it unmasked).
    A *page table* is ``[pages_per_row]`` int32: entry ``i`` is the page holding positions
    ``i*page_size .. (i+1)*page_size - 1`` of that sequence, 0 where none is assigned. The host side
    (``worker.kv_cache``) owns allocation, sharing and the tables; the runner only reads and writes pages.
    """

    backend: object  # the LoRA backend object in use (kernels.backends; str() names it); "fake" for the fake runner
    page_size: int  # tokens per KV page
    num_pages: int  # pages in the pool, the null page 0 included

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

    def prefill(self, batch: Sequence[PrefillInput]) -> list[int]:
        """For every sequence of ``batch`` (packed into as few calls as the runner's shapes allow):
        compute the keys/values of its ``tokens`` at positions ``start .. start+len-1`` under its adapter
        into the pages of its ``page_table``, attending to positions ``0 .. start-1`` already in those
        pages (a cached prefix); returns the token sampled after each sequence's last one, in order.
        A sequence may read pages an earlier sequence of the same batch writes (a prefix two prompts of
        one batch share): every sequence's keys/values of a layer are written before any attends."""

    def decode(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        sampling: list[SamplingRow | None],
    ) -> np.ndarray:
        """One step for every row: ``tokens``/``positions``/``slots`` are ``[B]`` int32 (slot -1 = base or
        idle row, ``sampling[i]`` None for idle rows), ``page_tables`` is ``[B, pages_per_row]`` int32 (all
        0 for idle rows; the caller rewrites it after the call returns, so a runner that hands it to an
        asynchronous device copies it); row b writes its token's k/v at ``positions[b]`` and attends to
        ``0..positions[b]``.
        Returns the next token per row, ``[B]`` int32.
        """
