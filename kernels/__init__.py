"""Batched multi-LoRA ops (DESIGN.md §6): shrink/expand over per-token adapter slots.

``from kernels import add_lora`` — see :mod:`kernels.api` for the signatures and the backends
(``reference``, ``xla``, ``pallas``, ``cpu``), :mod:`kernels.sgmv` for the grouped prefill path.
"""

from loraserve.kernels.api import (
    BACKENDS,
    add_lora,
    add_lora_sgmv,
    add_lora_slices,
    add_lora_slices_sgmv,
    backend_module,
    lora_expand,
    lora_expand_sgmv,
    lora_expand_slices,
    lora_shrink,
    lora_shrink_sgmv,
    resolve_backend,
)
from loraserve.kernels.sgmv import segments_to_idx

__all__ = [
    "BACKENDS",
    "add_lora",
    "add_lora_sgmv",
    "add_lora_slices",
    "add_lora_slices_sgmv",
    "backend_module",
    "lora_expand",
    "lora_expand_sgmv",
    "lora_expand_slices",
    "lora_shrink",
    "lora_shrink_sgmv",
    "resolve_backend",
    "segments_to_idx",
]
