"""Device kernels: the batched multi-LoRA ops (docs/design.md §6: shrink/expand over per-token adapter slots), paged
decode attention (:mod:`kernels.attention`) and the linear layers over float, int8 and int4 weights
(:mod:`kernels.linear`, the C++ CPU kernels of :mod:`kernels.cpu`).

The multi-LoRA ops come at two levels:

* the LoRA backend objects of :mod:`kernels.backends` (``reference``, ``xla-onehot``, ``xla-grouped``,
  ``cpu``, ``pallas``): pool layout, host→pool conversion, per-batch plan and ops, what the worker's
  model calls; ``resolve_backend("auto")`` picks one;
* the function-level ops of :mod:`kernels.api` (``add_lora(..., backend="xla-onehot")`` etc., one signature,
  docs/design.md §6 layout), :mod:`kernels.sgmv` for the grouped prefill path.
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
)
from loraserve.kernels.backends import (
    ALIASES,
    KERNEL_BACKENDS,
    LORA_BACKENDS,
    CpuBackend,
    LoraBackend,
    PallasBackend,
    ReferenceBackend,
    XlaGroupedBackend,
    XlaOneHotBackend,
    get_backend,
    pool_kind,
    resolve_backend,
)
from loraserve.kernels.sgmv import segments_to_idx

__all__ = [
    "ALIASES",
    "BACKENDS",
    "KERNEL_BACKENDS",
    "LORA_BACKENDS",
    "CpuBackend",
    "LoraBackend",
    "PallasBackend",
    "ReferenceBackend",
    "XlaGroupedBackend",
    "XlaOneHotBackend",
    "add_lora",
    "add_lora_sgmv",
    "add_lora_slices",
    "add_lora_slices_sgmv",
    "backend_module",
    "get_backend",
    "lora_expand",
    "lora_expand_sgmv",
    "lora_expand_slices",
    "lora_shrink",
    "lora_shrink_sgmv",
    "pool_kind",
    "resolve_backend",
    "segments_to_idx",
]
