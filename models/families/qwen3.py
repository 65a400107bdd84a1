"""Qwen3: Llama with an RMSNorm of each q and k head before RoPE, an explicit ``head_dim`` (the q size may
differ from the hidden size), no qkv bias unless ``attention_bias``; Qwen's optional sliding window."""

from __future__ import annotations

from typing import Any

from loraserve.models.families import rules

MODEL_TYPE = "qwen3"


def fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    return {"qk_norm": True, **rules.sliding(cfg, layers, rules.after_max_window_layers, gated=True)}
