"""What several families share in reading their configs: sliding-window layers, RoPE parameters, Gemma's
norms and scales, mixture-of-experts routing; and the refusal of what no family serves."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from loraserve.common.errors import FailedPrecondition

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SLIDING, FULL = "sliding_attention", "full_attention"


class UnsupportedModelError(FailedPrecondition, ValueError):
    """The checkpoint is not of an architecture this worker serves (FAILED_PRECONDITION)."""


def opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def rope(
    params: dict[str, Any], legacy: dict[str, Any], default_theta: float
) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from a 5.x ``rope_parameters`` dict and a 4.x ``rope_scaling`` one."""
    theta = float(params.pop("rope_theta", default_theta))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return theta, None if rope_type == "default" else {**scaling, "rope_type": rope_type}


def every_layer(cfg: dict[str, Any], layers: int) -> list[str]:
    """Mistral's rule: the window applies to every layer."""
    return [SLIDING] * layers


def after_max_window_layers(cfg: dict[str, Any], layers: int) -> list[str]:
    """Qwen's rule: layers from ``max_window_layers`` on slide."""
    first = int(cfg.get("max_window_layers", layers))
    return [SLIDING if i >= first else FULL for i in range(layers)]


def sliding(
    cfg: dict[str, Any],
    layers: int,
    rule: Callable[[dict[str, Any], int], list[str]],
    gated: bool = False,
) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as transformers derives them: the config's ``layer_types``, else
    ``rule`` (configs saved without them); ``gated``: only with ``use_sliding_window`` (Qwen)."""
    window = cfg.get("sliding_window")
    if gated and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return {"sliding_window": None, "layer_types": ()}
    types = cfg.get("layer_types")
    if types is None:
        types = rule(cfg, layers)
    if len(types) != layers or not set(types) <= {SLIDING, FULL}:
        raise UnsupportedModelError(f"layer_types {types!r} are not supported ({SLIDING}, {FULL} per layer)")
    return {"sliding_window": int(window), "layer_types": tuple(types)}


def gemma(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 and 3: RMSNorm times ``1 + w`` in f32, four norms a layer, embeddings times sqrt(hidden), the
    activation named ``hidden_activation``, attention scaled by ``query_pre_attn_scalar``, soft-capping, a tied
    head unless the config says otherwise."""
    return {
        "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "gemma_norm": True,
        "sandwich_norms": True,
        "embed_scale": math.sqrt(int(cfg["hidden_size"])),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcap": opt_float(cfg.get("attn_logit_softcapping")),
        "final_logit_softcap": opt_float(cfg.get("final_logit_softcapping")),
    }


def moe(
    model_type: str, cfg: dict[str, Any], *, expert_width: str, always_renormalise: bool = False
) -> dict[str, Any]:
    """The mixture-of-experts fields (every layer sparse): experts, top-k, one expert's width (the config
    field ``expert_width``), whether the k weights are renormalised."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    k = int(cfg.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < k <= experts:
        raise UnsupportedModelError(
            f"{model_type}: num_experts {experts} and num_experts_per_tok {k} do not make a MoE"
        )
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedModelError(
            f"{model_type} with dense layers among the sparse ones (mlp_only_layers, decoder_sparse_step) is not served"
        )
    return {
        "num_experts": experts,
        "experts_per_token": k,
        "moe_intermediate_size": int(cfg[expert_width]),
        "norm_topk_prob": True if always_renormalise else bool(cfg.get("norm_topk_prob", False)),
    }
