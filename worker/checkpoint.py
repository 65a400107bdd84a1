"""Load a Hugging Face Llama-family (Llama, Mistral, Qwen2/3, Gemma 2/3 text, and the mixture-of-experts
Qwen3-MoE, Mixtral, Qwen2-MoE) checkpoint folder (local path or fsspec URL) into stacked JAX arrays.

The folder holds ``config.json`` and one or many ``*.safetensors`` (sharded checkpoints carry a
``model.safetensors.index.json``). Matrices stay in Hugging Face's ``[out, in]`` layout, one dict per layer
(see ``worker.model`` for why not stacked), and q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import jax
import jax.numpy as jnp
import numpy as np

from loraserve.adapters.peft import safetensors_to_numpy
from loraserve.common.errors import InvalidArgument
from loraserve.worker.model_config import ModelConfig

Params = dict[str, Any]


class CheckpointError(InvalidArgument, ValueError):
    """The checkpoint folder is missing files or tensors, or they have the wrong shape (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded base model: its config, its parameters and where it came from."""

    config: ModelConfig
    params: Params
    source: str
    dtype: str
    quantization: str = "none"  # worker.quant: "int8" = the projections are Int8Weights


def _open_folder(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/")


def read_config(url: str) -> dict[str, Any]:
    fs, root = _open_folder(url)
    try:
        with fs.open(f"{root}/config.json", "rb") as f:
            return json.load(f)
    except FileNotFoundError as exc:
        raise CheckpointError(f"no config.json in {url}") from exc


def _weight_files(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    index = f"{root}/model.safetensors.index.json"
    if fs.exists(index):
        with fs.open(index, "rb") as f:
            weight_map = json.load(f)["weight_map"]
        return [f"{root}/{name}" for name in sorted(set(weight_map.values()))]
    files = sorted(p for p in fs.ls(root, detail=False) if str(p).endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {root}; .bin/.pt checkpoints are refused (pickle)")
    return files


def _iter_tensors(url: str) -> Iterator[tuple[str, np.ndarray]]:
    fs, root = _open_folder(url)
    for path in _weight_files(fs, root):
        with fs.open(path, "rb") as f:
            tensors = _load_any_dtype(f.read())
        yield from tensors.items()


def _load_any_dtype(data: bytes) -> dict[str, np.ndarray]:
    """safetensors bytes -> numpy arrays; bf16 tensors come back as float32 (exact)."""
    return safetensors_to_numpy(data)


def _take(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        t = tensors.pop(name)
    except KeyError as exc:
        raise CheckpointError(f"checkpoint lacks tensor {name}") from exc
    if tuple(t.shape) != shape:
        raise CheckpointError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
    return np.asarray(t, dtype=np.float32)


def convert_hf_weights(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """HF tensor dict -> our layout (float32 numpy, ``[out, in]`` matrices, ``layers``: one dict per layer)."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    tensors = dict(tensors)
    out: dict[str, np.ndarray] = {"embed": _take(tensors, "model.embed_tokens.weight", (cfg.vocab_size, h))}
    out["final_norm"] = _take(tensors, "model.norm.weight", (h,))
    if "lm_head.weight" in tensors and not cfg.tie_word_embeddings:
        out["lm_head"] = _take(tensors, "lm_head.weight", (cfg.vocab_size, h))
    layers: dict[str, list[np.ndarray]] = {}

    def add(key: str, value: np.ndarray) -> None:
        layers.setdefault(key, []).append(value)

    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        add("attn_norm", _take(tensors, p + "input_layernorm.weight", (h,)))
        if cfg.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention output
            add("post_attn_norm", _take(tensors, p + "post_attention_layernorm.weight", (h,)))
            add("mlp_norm", _take(tensors, p + "pre_feedforward_layernorm.weight", (h,)))
            add("post_mlp_norm", _take(tensors, p + "post_feedforward_layernorm.weight", (h,)))
        else:
            add("mlp_norm", _take(tensors, p + "post_attention_layernorm.weight", (h,)))
        if cfg.qk_norm:
            add("q_norm", _take(tensors, p + "self_attn.q_norm.weight", (cfg.head_dim,)))
            add("k_norm", _take(tensors, p + "self_attn.k_norm.weight", (cfg.head_dim,)))
        wq = _take(tensors, p + "self_attn.q_proj.weight", (q, h))
        wk = _take(tensors, p + "self_attn.k_proj.weight", (kv, h))
        wv = _take(tensors, p + "self_attn.v_proj.weight", (kv, h))
        add("wqkv", np.concatenate([wq, wk, wv], axis=0))
        if cfg.qkv_bias:
            add(
                "bqkv",
                np.concatenate(
                    [
                        _take(tensors, p + "self_attn.q_proj.bias", (q,)),
                        _take(tensors, p + "self_attn.k_proj.bias", (kv,)),
                        _take(tensors, p + "self_attn.v_proj.bias", (kv,)),
                    ]
                ),
            )
        add("wo", _take(tensors, p + "self_attn.o_proj.weight", (h, q)))
        if cfg.o_bias:
            add("bo", _take(tensors, p + "self_attn.o_proj.bias", (h,)))
        if cfg.is_moe:
            for key, value in _experts(cfg, tensors, p).items():
                add(key, value)
            continue
        wg = _take(tensors, p + "mlp.gate_proj.weight", (i, h))
        wu = _take(tensors, p + "mlp.up_proj.weight", (i, h))
        add("w_gate_up", np.concatenate([wg, wu], axis=0))
        add("w_down", _take(tensors, p + "mlp.down_proj.weight", (h, i)))
        if cfg.mlp_bias:
            add(
                "b_gate_up",
                np.concatenate(
                    [
                        _take(tensors, p + "mlp.gate_proj.bias", (i,)),
                        _take(tensors, p + "mlp.up_proj.bias", (i,)),
                    ]
                ),
            )
            add("b_down", _take(tensors, p + "mlp.down_proj.bias", (h,)))
    out["layers"] = [{k: v[n] for k, v in layers.items()} for n in range(cfg.num_layers)]
    return out


def _experts(cfg: ModelConfig, tensors: dict[str, np.ndarray], p: str) -> dict[str, np.ndarray]:
    """One sparse layer's router and experts (and shared expert): ``router [E, H]``, ``experts_gate_up
    [E, H, 2I]`` and ``experts_down [E, I, H]`` (input-major per expert: the grouped matmul's right-hand
    side), ``shared_gate_up``/``shared_down``/``shared_gate [1, H]`` for Qwen2-MoE's shared expert.

    Both layouts: transformers 5.x's fused ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``,
    and the per-expert modules before it (``mlp.experts.<e>.{gate,up,down}_proj``; Mixtral's
    ``block_sparse_moe.experts.<e>.{w1,w3,w2}`` and ``block_sparse_moe.gate``).
    """
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    out: dict[str, np.ndarray] = {}
    block = p + ("mlp." if p + "mlp.gate.weight" in tensors else "block_sparse_moe.")
    out["router"] = _take(tensors, block + "gate.weight", (e, h))
    if block + "experts.gate_up_proj" in tensors:
        gate_up = _take(tensors, block + "experts.gate_up_proj", (e, 2 * i, h))
        down = _take(tensors, block + "experts.down_proj", (e, h, i))
    else:
        names = (
            ("w1", "w3", "w2")
            if block.endswith("block_sparse_moe.")
            else ("gate_proj", "up_proj", "down_proj")
        )
        per = [block + f"experts.{x}." for x in range(e)]
        gate_up = np.stack(
            [
                np.concatenate(
                    [
                        _take(tensors, q + f"{names[0]}.weight", (i, h)),
                        _take(tensors, q + f"{names[1]}.weight", (i, h)),
                    ]
                )
                for q in per
            ]
        )
        down = np.stack([_take(tensors, q + f"{names[2]}.weight", (h, i)) for q in per])
    out["experts_gate_up"] = np.ascontiguousarray(gate_up.transpose(0, 2, 1))
    out["experts_down"] = np.ascontiguousarray(down.transpose(0, 2, 1))
    if cfg.shared_expert_size:
        s, q = cfg.shared_expert_size, block + "shared_expert."
        wg, wu = _take(tensors, q + "gate_proj.weight", (s, h)), _take(tensors, q + "up_proj.weight", (s, h))
        out["shared_gate_up"] = np.concatenate([wg, wu], axis=0)
        out["shared_down"] = _take(tensors, q + "down_proj.weight", (h, s))
        out["shared_gate"] = _take(tensors, block + "shared_expert_gate.weight", (1, h))
    return out


def load_checkpoint(
    url: str, dtype: str = "float32", quantization: str = "none", place: bool = True
) -> Checkpoint:
    """Read ``config.json`` + safetensors from ``url`` and place the stacked weights on the device (``place``
    False: keep them host arrays of ``dtype``, for a runner that splits them over a mesh, so that no device
    ever holds the whole model);
    ``quantization="int8"`` stores the layers' projections as int8 with per-channel scales, ``"int4"`` as
    packed int4 with a scale per group of inputs (worker.quant). A checkpoint ``loraserve quantize`` wrote
    (``worker.quantize_cmd``) is served as it was written whatever ``quantization`` says: its values and
    scales are taken as they are (checked: every scale present, of its shape, finite and positive), not
    quantized again.

    Semantics: the returned params compute exactly what transformers' ``*ForCausalLM`` of the family computes
    (quantized: what it computes with those weights dequantized).
    """
    from loraserve.worker.quant import QUANTIZATIONS, QUANTIZED, quantize_layers

    if quantization not in QUANTIZATIONS:
        raise InvalidArgument(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    hf_config = read_config(url)
    cfg = ModelConfig.from_hf(hf_config)
    written = _prequantized(hf_config)
    put = jax.device_put if place else _host
    if written:
        return _load_prequantized(cfg, url, dtype, written, put)
    host = convert_hf_weights(cfg, dict(_iter_tensors(url)))
    jdtype = jnp.dtype(dtype)
    skip = set(QUANTIZED) if quantization != "none" else set()
    floats = {k: v for k, v in host.items() if k != "layers"}
    floats["layers"] = [{k: v for k, v in layer.items() if k not in skip} for layer in host["layers"]]
    params = jax.tree.map(lambda v: put(v.astype(jdtype)), floats)
    if skip:
        params["layers"] = quantize_layers(params["layers"], host["layers"], quantization, put)
    return Checkpoint(config=cfg, params=params, source=url, dtype=jdtype.name, quantization=quantization)


def _host(value: np.ndarray) -> np.ndarray:
    """``load_checkpoint(place=False)``'s stand-in for ``jax.device_put``."""
    return value


def _prequantized(hf_config: dict[str, Any]) -> str:
    """The quantization ("int8" | "int4") ``config.json`` says ``loraserve quantize`` wrote, "" for an
    unquantized checkpoint; another method is refused."""
    from loraserve.worker.quantize_cmd import QUANT_METHODS

    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    if method is None:
        return ""
    written = {m: q for q, m in QUANT_METHODS.items()}.get(method)
    if written is None:
        raise CheckpointError(
            f"quantization_config.quant_method {method!r} is not served (only "
            f"{', '.join(map(repr, QUANT_METHODS.values()))}, which `loraserve quantize` writes; or an "
            "unquantized checkpoint with --quantization int8|int4)"
        )
    return written


# each fused projection's HF modules, in the order convert_hf_weights stacks their rows
_FUSED = {
    "wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "wo": ("self_attn.o_proj",),
    "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "w_down": ("mlp.down_proj",),
}


def _load_prequantized(
    cfg: ModelConfig, url: str, dtype: str, quantization: str, put: Callable[[Any], Any]
) -> Checkpoint:
    """A ``loraserve quantize`` checkpoint: each projection's int8 (or packed int4) values with their
    ``_scale`` (checked and named when wrong), fused as ``convert_hf_weights`` fuses the float weights (rows
    side by side, each row's scales with it); the rest as any checkpoint."""
    from loraserve.worker.quant import QUANTIZED, Int4Weight, Int8Weight, int4_group, pack_int4, unpack_int4
    from loraserve.worker.quantize_cmd import PROJECTION, SCALE_SUFFIX

    int4 = quantization == "int4"
    stored = np.uint8 if int4 else np.int8
    tensors = dict(_iter_tensors(url))
    scales: dict[str, np.ndarray] = {}
    for name in [k for k in tensors if PROJECTION.match(k)]:
        q = tensors[name]
        if q.dtype != stored or q.ndim != 2:
            raise CheckpointError(
                f"tensor {name} is {q.dtype} of shape {tuple(q.shape)}; an {quantization} checkpoint stores it as a "
                f"2-d {np.dtype(stored).name} matrix"
            )
        scale = tensors.pop(name + SCALE_SUFFIX, None)
        if scale is None:
            raise CheckpointError(f"checkpoint lacks tensor {name + SCALE_SUFFIX} (the scales of {name})")
        inputs = 2 * q.shape[1] if int4 else q.shape[1]
        want = (q.shape[0], inputs // int4_group(inputs)) if int4 else (q.shape[0],)
        if scale.shape != want:
            packed = f" for {name} {tuple(q.shape)} (packed: {inputs} inputs)" if int4 else ""
            raise CheckpointError(
                f"tensor {name + SCALE_SUFFIX} has shape {tuple(scale.shape)}, expected {want}{packed}"
            )
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise CheckpointError(
                f"tensor {name + SCALE_SUFFIX} holds a scale that is not finite and positive"
            )
        scales[name] = np.asarray(scale, np.float32)
        # exact as floats: convert_hf_weights checks and fuses them as it does float weights
        tensors[name] = (unpack_int4(q) if int4 else q).astype(np.float32)
    stray = sorted(k for k in tensors if k.endswith(SCALE_SUFFIX))
    if stray:
        raise CheckpointError(f"tensor {stray[0]} scales no {quantization} projection of this checkpoint")
    host = convert_hf_weights(cfg, tensors)
    jdtype = jnp.dtype(dtype)
    floats = {k: v for k, v in host.items() if k != "layers"}
    floats["layers"] = [{k: v for k, v in layer.items() if k not in QUANTIZED} for layer in host["layers"]]
    params = jax.tree.map(lambda v: put(v.astype(jdtype)), floats)
    for n, (layer, values) in enumerate(zip(params["layers"], host["layers"], strict=True)):
        for key in QUANTIZED:
            if key not in values:
                continue
            modules = [f"model.layers.{n}.{m}.weight" for m in _FUSED[key]]
            missing = [m for m in modules if m not in scales]
            if missing:
                raise CheckpointError(f"tensor {missing[0]} is not {quantization} in a quantized checkpoint")
            scale = np.concatenate([scales[m] for m in modules])
            q = values[key].astype(np.int8)
            weight = Int4Weight(pack_int4(q), scale) if int4 else Int8Weight(q, scale)
            layer[key] = jax.tree.map(put, weight)
    return Checkpoint(config=cfg, params=params, source=url, dtype=jdtype.name, quantization=quantization)
