"""Qwen2-MoE: Qwen2's attention (q/k/v bias unless ``qkv_bias`` is false; no o bias); every layer's MLP a
mixture of experts of width ``moe_intermediate_size`` plus a shared expert every token takes, times the
sigmoid of its gate (``shared_expert_intermediate_size``); Qwen's optional sliding window."""

from __future__ import annotations

from typing import Any

from loraserve.models.families import rules

MODEL_TYPE = "qwen2_moe"


def fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    return {
        "qkv_bias": bool(cfg.get("qkv_bias", True)) or bool(cfg.get("attention_bias", False)),
        "o_bias": False,
        **rules.moe(MODEL_TYPE, cfg, expert_width="moe_intermediate_size"),
        "shared_expert_size": int(cfg.get("shared_expert_intermediate_size") or 0),
        **rules.sliding(cfg, layers, rules.after_max_window_layers, gated=True),
    }
