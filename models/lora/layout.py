"""The slot pools' layout: every pool's name and one slot's shape in the canonical layout (docs/design.md §6),
the DoRA-scale and LoRA-bias vectors' sizes, and zeroed pools for a model (``empty_lora``) in a LoRA backend's
layout, with the vector, expert and vocabulary pools beside them."""

from __future__ import annotations

from typing import Any

from loraserve.kernels.backends import LoraBackend
from loraserve.models.config import ModelConfig
from loraserve.models.lora.dora_bias import init_vector_pools
from loraserve.models.lora.embedding import init_vocab_pools
from loraserve.models.moe import init_expert_pools
from loraserve.models.step import LoraPools


def lora_slot_shapes(cfg: ModelConfig, max_rank: int) -> dict[str, tuple[int, int]]:
    """Pool name -> one slot's matrix in the canonical layout (docs/design.md §6), the same for every layer.

    Semantics: ``A_<group>`` is ``[in, n*R]`` (the group's n modules side by side on the rank axis),
    ``B_<module>`` is ``[R, out]``; a backend's pools store them in its own layout.
    """
    shapes = cfg.module_shapes()
    out: dict[str, tuple[int, int]] = {}
    for group, modules in cfg.lora_groups.items():
        out[f"A_{group}"] = (shapes[modules[0]][0], len(modules) * max_rank)
        out.update({b_name(m): (max_rank, shapes[m][1]) for m in modules})
    return out


def empty_lora(
    cfg: ModelConfig, max_loras: int, max_rank: int, dtype: Any, backend: LoraBackend
) -> LoraPools:
    """Zeroed slot pools, in ``backend``'s layout, for ``max_loras`` adapters of rank up to ``max_rank``
    on all seven modules, plus the DoRA-scale (ones) and LoRA-bias (zeros) vector pools of ``models.lora.dora_bias``
    per layer, a mixture of experts' expert and router pools (``models.moe.expert_slot_shapes``), and the embed_tokens / lm_head pools of ``models.lora.embedding`` (``LoraPools.vocab``)."""
    pools = backend.init_pools(lora_slot_shapes(cfg, max_rank), cfg.num_layers, max_loras, dtype)
    layers = [
        {
            **layer,
            **init_vector_pools(lora_vector_sizes(cfg), max_loras),
            **init_expert_pools(cfg, max_loras, max_rank, dtype),
        }
        for layer in pools
    ]
    return LoraPools(layers, init_vocab_pools(cfg, max_loras, max_rank, dtype))


def lora_vector_sizes(cfg: ModelConfig) -> dict[str, int]:
    """LoRA group -> its fused output size: the length of one slot's DoRA-scale and LoRA-bias vectors."""
    shapes = cfg.module_shapes()
    return {group: sum(shapes[m][1] for m in modules) for group, modules in cfg.lora_groups.items()}


def b_name(module: str) -> str:
    """Pool name of a module's B matrices, e.g. ``q_proj -> B_q``."""
    return "B_" + module.removesuffix("_proj")
