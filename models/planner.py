"""Capacity planning: per-device bytes of a worker configuration on a TPU slice, before anything is allocated.

``plan(model, chip, tp, ...)`` counts what one device holds under the worker's tensor-parallel layout
(docs/design.md §10.2, ``docs/worker.md``): weights (q/k/v/gate/up split by output, o/down by input, embedding
and lm_head by vocab, KV heads replicated when there are fewer than devices), the KV cache (split by KV
head), the adapter slot pools (sharded like the layer they adapt: column-parallel A whole and B split,
row-parallel A split and B whole), and the peak activations of a prefill and a decode step. It says
whether that fits the chip's HBM and how many hosts the slice spans.

*Semantics:* byte counts are exact for arrays (shape × dtype size); activations are an estimate of the
largest live intermediates (the XLA attention materialises its ``[heads, T, T]`` scores in f32). What the
runtime keeps for itself, mostly the compiled programs, is not counted: it is ``WorkerInfo.device_bytes_in_use``
less ``device_array_bytes`` on a running worker, tens of MB (36 MB for a 2-layer test model on a TPU v5e).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraserve.common.errors import FailedPrecondition, InvalidArgument
from loraserve.models.sizes import history_bytes

if TYPE_CHECKING:  # numpy and JAX stay out of `loraserve --help` (the CLI builds every subcommand's flags)
    from loraserve.models.config import ModelConfig

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output
ROW_PARALLEL = ("o_proj", "down_proj")  # split by input, one reduction


@dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int
    single_host_max: int  # the most chips one TPU VM drives (v5e/v6e: the 8-chip machine types)
    chips_per_host: int  # chips per host in a multi-host slice

    def hosts(self, chips: int) -> int:
        return 1 if chips <= self.single_host_max else math.ceil(chips / self.chips_per_host)


# Cloud TPU generations users serve on: HBM per chip; v5e and v6e slices up to 8 chips are one VM, larger
# ones are 4-chip hosts; v5p hosts have 4 chips.
CHIPS = {
    "v5e": Chip("v5e", 16 * GiB, 8, 4),
    "v5p": Chip("v5p", 95 * GiB, 4, 4),
    "v6e": Chip("v6e", 32 * GiB, 8, 4),
}


@dataclass(frozen=True)
class Plan:
    """What one device of a ``tp``-way slice holds, in bytes, and whether it fits."""

    model: str
    chip: str
    tp: int
    hosts: int
    dtype: str
    weights: int
    kv_cache: int
    lora_pools: int
    sampling_history: int  # the decode rows' RowHistory (logits controls), replicated on every device
    activations: int
    hbm: int

    @property
    def held(self) -> int:
        """What the decode step's state holds between steps (everything but the activations)."""
        return self.weights + self.kv_cache + self.lora_pools + self.sampling_history

    @property
    def total(self) -> int:
        return self.held + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total, "fits": self.fits}


def presets() -> dict[str, Path]:
    """Shipped example configs (Hugging Face ``config.json`` files): name -> path."""
    folder = resources.files("loraserve.models") / "presets"
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".json")}


def load_model_config(name_or_path: str) -> tuple[str, ModelConfig]:
    """A preset name (``llama-3-8b``), a ``config.json`` path, or a checkpoint folder holding one."""
    from loraserve.models.config import ModelConfig

    path = presets().get(name_or_path) or Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        known = ", ".join(sorted(presets()))
        raise InvalidArgument(
            f"{name_or_path!r} is neither a preset ({known}) nor a config.json or its folder"
        )
    return (path.stem if path.name != "config.json" else path.parent.name), ModelConfig.from_hf(
        json.loads(path.read_text())
    )


def kv_heads_per_device(cfg: ModelConfig, tp: int) -> int:
    """KV heads one device holds: split when they divide evenly, one (replicated) when fewer than devices."""
    if cfg.num_kv_heads >= tp:
        return cfg.num_kv_heads // tp
    return 1


def check_layout(cfg: ModelConfig, tp: int) -> None:
    """Refuse a tensor-parallel degree the Megatron layout cannot split (the worker's own start-up check)."""
    from loraserve.models.sharding import check_tensor_parallel

    check_tensor_parallel(cfg, tp, devices=tp)


def _module_shapes_per_device(cfg: ModelConfig, tp: int) -> dict[str, tuple[int, int]]:
    """``module -> (in, out)`` that one device holds of each projection."""
    kv_out = kv_heads_per_device(cfg, tp) * cfg.head_dim
    out = {}
    for module, (fan_in, fan_out) in cfg.module_shapes().items():
        if module in ("k_proj", "v_proj"):
            out[module] = (fan_in, kv_out)
        elif module in COLUMN_PARALLEL:
            out[module] = (fan_in, fan_out // tp)
        else:
            out[module] = (fan_in // tp, fan_out)
    return out


def vocab_rows_per_device(cfg: ModelConfig, tp: int) -> int:
    """Embedding/lm_head rows one device holds: split by vocab when N divides it, else replicated."""
    return cfg.vocab_size // tp if cfg.vocab_size % tp == 0 else cfg.vocab_size


def weight_bytes(
    cfg: ModelConfig, tp: int, dtype: str, quantization: str = "none", quantize_lm_head: bool = False
) -> int:
    """One device's base weights; with ``quantization="int8"`` the layers' projections at one byte an
    element plus an f32 scale per output channel, with ``"int4"`` at half a byte plus an f32 scale per group
    of inputs (models.quantization), the rest in ``dtype``; ``quantize_lm_head``: the head too, by vocab rows (a tied
    model keeps its embedding in ``dtype`` beside the quantized head)."""
    size = DTYPE_BYTES[dtype]
    projections = sum(i * o for i, o in _module_shapes_per_device(cfg, tp).values())
    per_layer = projections if quantization == "none" else 0
    per_layer += cfg.expert_bytes(1, tp)  # a mixture of experts: router, its share of experts, shared expert
    shapes = _module_shapes_per_device(cfg, tp)
    if cfg.qkv_bias:
        per_layer += shapes["q_proj"][1] + 2 * shapes["k_proj"][1]
    if cfg.o_bias:
        per_layer += cfg.hidden_size
    norms = cfg.hidden_size * (4 if cfg.model_type.startswith("gemma") else 2)  # replicated
    norms += 2 * cfg.head_dim if cfg.qk_norm else 0
    rows = vocab_rows_per_device(cfg, tp)
    embeddings = rows * cfg.hidden_size * (1 if cfg.tie_word_embeddings or quantize_lm_head else 2)
    floats = size * (cfg.num_layers * (per_layer + norms) + embeddings + cfg.hidden_size)
    if quantization == "none":
        return floats
    head = quantized_matrix_bytes(rows, cfg.hidden_size, quantization) if quantize_lm_head else 0
    return floats + head + cfg.num_layers * quantized_projection_bytes(cfg, tp, quantization)


def quantized_matrix_bytes(out: int, inputs: int, quantization: str, group_of: int | None = None) -> int:
    """``out`` rows of ``inputs`` quantized (models.quantization's layouts): int8 a byte a value and an f32 scale a
    row; int4 half a byte a value and an f32 scale per group (of ``group_of`` inputs' group size, default
    ``inputs``)."""
    from loraserve.models.quantization import int4_group

    if quantization == "int4":
        return out * inputs // 2 + 4 * out * (inputs // int4_group(group_of or inputs))
    return out * inputs + 4 * out


def check_int4_split(cfg: ModelConfig, tp: int) -> None:
    """Refuse (FailedPrecondition) a split that would cut an int4 group: a row-parallel projection's inputs
    are split over the devices, and each device's share must be whole groups (models.quantization)."""
    from loraserve.models.quantization import int4_group

    for module, (fan_in, _) in cfg.module_shapes().items():
        group = int4_group(fan_in)
        if module not in COLUMN_PARALLEL and (fan_in // tp) % group:
            raise FailedPrecondition(
                f"--quantization int4 over {tp} devices: {module}'s {fan_in} inputs split into {fan_in // tp} "
                f"per device, not a whole number of its groups of {group}"
            )


def quantized_projection_bytes(cfg: ModelConfig, tp: int, quantization: str) -> int:
    """One layer's quantized projections on one device: values and f32 scales (models.quantization's layouts)."""
    full = cfg.module_shapes()
    total = 0
    for module, (i, o) in _module_shapes_per_device(cfg, tp).items():
        total += quantized_matrix_bytes(
            o, i, quantization, full[module][0]
        )  # groups of the full input's size
    return total


def kv_bytes(cfg: ModelConfig, tp: int, batch: int, context: int, dtype: str, page_size: int = 16) -> int:
    """The default paged KV pool: ``batch`` full contexts of pages plus the null page (EngineConfig)."""
    tokens = (batch * -(-context // page_size) + 1) * page_size
    return DTYPE_BYTES[dtype] * 2 * cfg.num_layers * tokens * kv_heads_per_device(cfg, tp) * cfg.head_dim


def pool_bytes(cfg: ModelConfig, tp: int, max_loras: int, rank: int, dtype: str) -> int:
    """Slot pools sharded like their layer: column-parallel A whole + B split; row-parallel A split + B whole;
    plus the f32 DoRA-scale and LoRA-bias vectors (``models.lora.dora_bias``), split like their layer's output; plus
    once per model the embed_tokens / lm_head pools (``models.lora.embedding``): ``A_embed [V, R]`` and
    ``B_lm_head [R, V]`` split by vocab like the embedding (whole when N does not divide V), ``B_embed
    [R, H]`` and ``A_lm_head [H, R]`` whole; and on a mixture of experts every expert's gate/up and down
    LoRA and the router's (``ModelConfig.expert_shapes``)."""
    full = cfg.module_shapes()
    per_layer, vectors = 0, 0
    for module, (fan_in, fan_out) in _module_shapes_per_device(cfg, tp).items():
        if module in ROW_PARALLEL:
            per_layer += rank * (fan_in + full[module][1])
            vectors += 2 * full[module][1]
        else:
            per_layer += rank * (full[module][0] + fan_out)
            vectors += 2 * fan_out
    for target, (fan_in, fan_out) in cfg.expert_shapes().items():  # a mixture of experts' (models.moe)
        per_layer += rank * (fan_in + fan_out) * (1 if target == "router" else cfg.num_experts // tp)
    vocab = rank * (2 * vocab_rows_per_device(cfg, tp) + 2 * cfg.hidden_size)
    layers = cfg.num_layers * (DTYPE_BYTES[dtype] * per_layer + DTYPE_BYTES["float32"] * vectors)
    return max_loras * (layers + DTYPE_BYTES[dtype] * vocab)


def activation_bytes(cfg: ModelConfig, tp: int, batch: int, prefill_tokens: int, dtype: str) -> int:
    """Largest live intermediates: a prefill of ``prefill_tokens`` (hidden states, the fused qkv and gate_up
    outputs, f32 attention scores) or a decode step (f32 logits over this device's vocab share)."""
    t, h = prefill_tokens, cfg.hidden_size
    heads = cfg.num_heads // tp
    mlp = 2 * cfg.intermediate_size // tp
    if cfg.is_moe:  # per token: k experts' gate|up and down outputs (sorted pairs), and the shared expert's
        mlp = cfg.experts_per_token * (2 * cfg.moe_intermediate_size + cfg.hidden_size)
        mlp += 2 * cfg.shared_expert_size
    fused = (cfg.q_size // tp + 2 * kv_heads_per_device(cfg, tp) * cfg.head_dim) + mlp
    prefill = DTYPE_BYTES[dtype] * t * (3 * h + fused) + 4 * heads * t * t
    decode = 4 * batch * (vocab_rows_per_device(cfg, tp) + 3 * h + fused)
    return max(prefill, decode)


def plan(
    model: str,
    cfg: ModelConfig,
    chip: str,
    tp: int,
    *,
    max_loras: int,
    max_lora_rank: int,
    batch: int,
    context: int,
    dtype: str = "bfloat16",
    lora_dtype: str = "",
    quantization: str = "none",
    quantize_lm_head: bool = False,
) -> Plan:
    if chip not in CHIPS:
        raise InvalidArgument(f"unknown chip {chip!r}; known: {', '.join(CHIPS)}")
    if dtype not in DTYPE_BYTES or (lora_dtype or dtype) not in DTYPE_BYTES:
        raise InvalidArgument(f"dtypes must be one of {', '.join(DTYPE_BYTES)}")
    check_layout(cfg, tp)
    from loraserve.models.quantization import QUANTIZATIONS

    if quantization not in QUANTIZATIONS:
        raise InvalidArgument(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "int4":
        check_int4_split(cfg, tp)
    if quantize_lm_head and quantization == "none":
        raise FailedPrecondition("--quantize-lm-head needs --quantization int8 or int4")
    spec = CHIPS[chip]
    return Plan(
        model=model,
        chip=chip,
        tp=tp,
        hosts=spec.hosts(tp),
        dtype=dtype,
        weights=weight_bytes(cfg, tp, dtype, quantization, quantize_lm_head),
        kv_cache=kv_bytes(cfg, tp, batch, context, dtype),
        lora_pools=pool_bytes(cfg, tp, max_loras, max_lora_rank, lora_dtype or dtype),
        sampling_history=history_bytes(batch, cfg.vocab_size),
        activations=activation_bytes(cfg, tp, batch, context, dtype),
        hbm=spec.hbm_bytes,
    )
