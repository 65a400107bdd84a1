"""Llama 2 and 3.x: the base every other family differs from. RMSNorm (``x / rms(x)`` rounded to the model
dtype, times ``w``), SiLU gated MLP, RoPE (default, ``linear``, ``llama3`` scaling), GQA, an optional tied head,
``attention_bias`` / ``mlp_bias``; a ``sliding_window``, if a config has one, on every layer."""

from __future__ import annotations

from typing import Any

from loraserve.models.families import rules

MODEL_TYPE = "llama"


def fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    return rules.sliding(cfg, layers, rules.every_layer)
