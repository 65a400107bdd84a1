"""Mistral: Llama with ``sliding_window`` on every layer (the KV cache keeps every position; the mask keeps
the last ``sliding_window``)."""

from __future__ import annotations

from typing import Any

from loraserve.models.families import rules

MODEL_TYPE = "mistral"


def fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    return rules.sliding(cfg, layers, rules.every_layer)
