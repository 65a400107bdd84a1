"""Host values as named numpy arrays and back: a dataclass of arrays (``PrefillBatch``, ``SamplingArrays``) as
``prefix.field`` arrays, one slot's values as ``values.<layer>.<pool>`` arrays. What a device call sends a
multi-host follower (``engine.multihost``) is made of these."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np


def fields_of(prefix: str, value: Any) -> dict[str, np.ndarray]:
    """A dataclass of host arrays (``PrefillBatch``, ``SamplingArrays``) as ``prefix.field`` arrays; None
    fields are left out."""
    return {
        f"{prefix}.{f.name}": getattr(value, f.name)
        for f in dataclasses.fields(value)
        if getattr(value, f.name) is not None
    }


def dataclass_from(prefix: str, cls: type, arrays: Mapping[str, np.ndarray]) -> Any:
    """:func:`fields_of` back: fields absent from ``arrays`` are None."""
    return cls(**{f.name: arrays.get(f"{prefix}.{f.name}") for f in dataclasses.fields(cls)})


def slot_values_arrays(values: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """One slot's values (``models.lora.pools.SlotValues``: per layer, pool name -> array) as named arrays."""
    return {f"values.{n}.{k}": v for n, layer in enumerate(values) for k, v in layer.items()}


def slot_values_from(arrays: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    layers: dict[int, dict[str, np.ndarray]] = {}
    for name, a in arrays.items():
        if name.startswith("values."):
            _, n, key = name.split(".", 2)
            layers.setdefault(int(n), {})[key] = a
    return [layers[n] for n in range(len(layers))]
