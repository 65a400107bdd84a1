"""The architecture of a decoder-only checkpoint, read from its Hugging Face ``config.json``: ``ModelConfig``.

``ModelConfig.from_hf`` reads what every family shares (sizes, heads, RoPE and its scaling, EOS ids, biases; the
transformers 4.x layout, ``rope_theta`` / ``rope_scaling``, and the 5.x one, ``rope_parameters`` /
``layer_types``), then the fields of the config's family, one module each in ``models.families`` (Llama 2/3,
Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Qwen3-MoE, Mixtral, Qwen2-MoE). Every field defaults to Llama's
behaviour; the decoder (``models.decoder``) is switched by them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loraserve.models.families import FAMILIES
from loraserve.models.families.rules import FULL, SLIDING, UnsupportedModelError, rope

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# LoRA pool names: one A per fused matmul (ranks side by side), one B per module.
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# A mixture-of-experts model's dense LoRA targets: attention (its experts' LoRA is separate)
ATTENTION_GROUPS = {g: LORA_GROUPS[g] for g in ("qkv", "o")}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of one decoder-only Llama-family model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_act: str = "silu"
    gemma_norm: bool = False  # RMSNorm scales by (1 + w), all in f32; else by w after rounding (Llama)
    sandwich_norms: bool = False  # Gemma: norms after attention and after the MLP too, before the residual
    qk_norm: bool = False  # RMSNorm of every q and k head before RoPE (Qwen3, Gemma 3)
    embed_scale: float | None = None  # embeddings times this, in the embedding dtype (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (else head_dim ** -0.5)
    attn_logit_softcap: float | None = None  # scores -> tanh(s / cap) * cap before the mask
    final_logit_softcap: float | None = None  # logits -> tanh(l / cap) * cap
    sliding_window: int | None = None  # a sliding layer's query attends to the last this many positions
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL; empty = all FULL
    local_rope_theta: float | None = None  # a separate RoPE table for sliding layers (Gemma 3)
    local_rope_scaling: dict[str, Any] | None = None
    # mixture of experts (every layer): router -> softmax (f32) -> top-k -> optional renormalisation
    num_experts: int = 0  # 0 = a dense model
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # one expert's MLP width
    norm_topk_prob: bool = False  # the k weights divided by their sum (Mixtral always)
    routing_in_f32: bool = False  # the routing weights stay f32 when scaling expert outputs (Mixtral)
    shared_expert_size: int = 0  # Qwen2-MoE: a dense MLP every token takes, times sigmoid(its gate)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``: what every family shares read here, then its family's fields
        (``models.families``); raises UnsupportedModelError for other architectures."""
        model_type = cfg.get("model_type", "llama")
        family = FAMILIES.get(model_type)
        if family is None:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not served; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                f"{model_type} with use_bidirectional_attention is not served (causal only)"
            )
        params = dict(cfg.get("rope_parameters") or {})
        local: dict[str, Any] = {}
        if FULL in params or SLIDING in params:  # 5.x, one parameter set per layer type (Gemma 3)
            theta, scaling = rope(
                dict(params.get(SLIDING) or {}), {}, float(cfg.get("rope_local_base_freq", 10000.0))
            )
            local = {"local_rope_theta": theta, "local_rope_scaling": scaling}
            params = dict(params.get(FULL) or {})
        theta, scaling = rope(params, cfg.get("rope_scaling") or {}, float(cfg.get("rope_theta", 10000.0)))
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        attention_bias = bool(cfg.get("attention_bias", False))
        shared = dict(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            hidden_act=cfg.get("hidden_act") or "silu",
            **local,
        )
        config = cls(**{**shared, **family.fields(cfg, layers)})
        if config.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"{model_type} hidden activation {config.hidden_act!r} is not supported"
                f" ({', '.join(SUPPORTED_ACTIVATIONS)})"
            )
        return config

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def lora_groups(self) -> dict[str, tuple[str, ...]]:
        """The fused matmuls dense LoRA pools adapt: all four, or attention's on a mixture of experts."""
        return ATTENTION_GROUPS if self.is_moe else LORA_GROUPS

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """The factor on ``q . k``: ``query_pre_attn_scalar ** -0.5`` (Gemma) or ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window (static per layer)."""
        return (
            bool(self.layer_types) and self.layer_types[layer] == SLIDING and self.sliding_window is not None
        )

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``module -> (in_features, out_features)`` of every adaptable projection."""
        h, i = self.hidden_size, self.intermediate_size
        shapes = {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        return {m: shapes[m] for modules in self.lora_groups.values() for m in modules}

    def expert_bytes(self, itemsize: int, devices: int = 1) -> int:
        """One layer's mixture-of-experts weights on one of ``devices`` (expert parallelism: the experts
        split, the router and the shared expert with its gate whole); 0 for a dense model."""
        if not self.is_moe:
            return 0
        h, e = self.hidden_size, self.num_experts
        experts = 3 * h * (e // devices) * self.moe_intermediate_size
        shared = 3 * h * self.shared_expert_size + (h if self.shared_expert_size else 0)
        return itemsize * (e * h + experts + shared)

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """A mixture of experts' LoRA targets (``adapters.peft_experts``), ``(in, out)`` of one expert:
        ``experts.gate_up_proj (hidden, 2 * moe_intermediate)``, ``experts.down_proj (moe_intermediate,
        hidden)``, and ``router (hidden, experts)``; empty for a dense model."""
        if not self.is_moe:
            return {}
        h, i = self.hidden_size, self.moe_intermediate_size
        return {
            "experts.gate_up_proj": (h, 2 * i),
            "experts.down_proj": (i, h),
            "router": (h, self.num_experts),
        }

    def adapter_shapes(self) -> dict[str, tuple[int, int]]:
        """``module_shapes`` plus the vocabulary-sized LoRA targets: ``embed_tokens (vocab, hidden)`` and
        ``lm_head (hidden, vocab)`` (``adapters.peft.VOCAB_MODULES``), and a mixture of experts' targets
        (``expert_shapes``): what an adapter is validated against."""
        v, h = self.vocab_size, self.hidden_size
        return {**self.module_shapes(), "embed_tokens": (v, h), "lm_head": (h, v), **self.expert_shapes()}

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies (float64): ``[head_dim // 2]``, or ``[2, head_dim // 2]`` (global, local)
        when sliding layers have a RoPE table of their own (Gemma 3).

        Semantics: the per-pair rotation speed used by transformers' rotary embedding for this rope_type.
        """
        glob = _inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
        if self.local_rope_theta is None:
            return glob
        return np.stack([glob, _inv_freq(self.head_dim, self.local_rope_theta, self.local_rope_scaling)])


def _inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)
    return inv
