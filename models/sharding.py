"""Tensor parallelism: the ``model`` mesh, the Megatron layout of every array, and the checks at start.

Layout over a 1-D mesh of N devices, axis ``model`` (``docs/worker.md``):

* ``wqkv [q+2kv, in]`` and ``w_gate_up [2I, in]`` (and their biases) split by output rows, their rows
  re-ordered at load so device s holds its own q, k, v (gate, up) slices (:func:`fuse_order`;
  ``models.layers.split_fused`` reads them back);
* ``wo [H, q]`` and ``w_down [H, I]`` split by input columns (one all-reduce of ``[tokens, H]`` each);
* ``embed`` and ``lm_head [V, H]`` split by vocab rows (when N divides V; replicated otherwise);
* the KV cache split by KV head; with ``kv_heads < N`` every KV head is repeated ``N / kv_heads``
  times in the weights, the k/v LoRA B matrices and the cache (vLLM does the same), so each device
  holds the one its q heads read;
* slot pools split like the layer they adapt (``kernels.sharded``); norms and the rest replicated;
* a mixture of experts' experts (and their LoRA pools) split by expert, N dividing the expert count
  (expert parallelism, ``models.moe``); its router and shared expert replicated.

N = 1 uses none of this: the runner keeps its single-device path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from loraserve.common.errors import FailedPrecondition, InvalidArgument
from loraserve.kernels.backends import COLUMN, ROW, LoraBackend, pool_kind
from loraserve.kernels.sharded import AXIS, ShardedBackend
from loraserve.models.config import ModelConfig
from loraserve.models.decoder import kv_page_bytes, kv_storage_dtype
from loraserve.models.lora.dora_bias import VECTOR_DTYPE, bias_name, scale_name
from loraserve.models.lora.embedding import VOCAB_POOLS, vocab_slot_shapes
from loraserve.models.lora.layout import b_name, lora_slot_shapes, lora_vector_sizes
from loraserve.models.moe import EXPERT_POOLS, ROUTER_POOLS, init_expert_pools
from loraserve.models.step import LoraPools

# Which way each LoRA group's layer is split (Megatron): by output (column) or by input (row).
GROUP_PARALLEL: dict[str, str] = {"qkv": COLUMN, "o": ROW, "gate_up": COLUMN, "down": ROW}
# Per-layer parameter -> the dimension split over ``model`` (absent: replicated).
LAYER_SPLIT_DIM: dict[str, int] = {"wqkv": 0, "bqkv": 0, "w_gate_up": 0, "b_gate_up": 0, "wo": 1, "w_down": 1}
# a mixture of experts: split by expert (expert parallelism, models.moe); router and shared expert whole
LAYER_SPLIT_DIM |= {"experts_gate_up": 0, "experts_down": 0}
# Slot values that are fused [out] vectors (models.lora.dora_bias: magnitude_<g>, dora_<g>, lora_bias_<g>).
VECTOR_VALUES = ("magnitude_", "dora_", "lora_bias_")
CACHE_SPEC = P(AXIS, None, None, None)  # k and v pages [kv_heads, pages, page_size, D]: by KV head


def check_tensor_parallel(cfg: ModelConfig, n: int, devices: int) -> None:
    """Refuse a tensor-parallel size the model or the machine cannot take, naming the numbers.

    ``InvalidArgument`` when N does not divide the heads or the intermediate size, or neither of N and
    the KV heads divides the other; ``FailedPrecondition`` when N exceeds the visible devices.
    """
    if n < 1:
        raise InvalidArgument(f"tensor_parallel_size must be >= 1, got {n}")
    if n > devices:
        raise FailedPrecondition(
            f"tensor_parallel_size {n} is larger than the {devices} visible {jax.default_backend()} devices"
        )
    if cfg.is_moe and cfg.num_experts % n:
        raise InvalidArgument(
            f"tensor_parallel_size {n} does not divide the model's {cfg.num_experts} experts (a mixture of "
            "experts splits them over the devices)"
        )
    if cfg.num_heads % n:
        raise InvalidArgument(f"tensor_parallel_size {n} does not divide the model's {cfg.num_heads} heads")
    if not cfg.is_moe and cfg.intermediate_size % n:
        raise InvalidArgument(
            f"tensor_parallel_size {n} does not divide the model's intermediate size {cfg.intermediate_size}"
        )
    k = cfg.num_kv_heads
    if k % n and n % k:
        raise InvalidArgument(
            f"tensor_parallel_size {n} and the model's {k} KV heads: one must divide the other"
        )


def make_mesh(n: int, devices: list[Any] | None = None) -> Mesh:
    """A 1-D mesh ``(model: n)`` over the first n devices (``jax.devices()`` by default)."""
    devs = (devices if devices is not None else jax.devices())[:n]
    return Mesh(np.array(devs), (AXIS,))


def kv_repeat(cfg: ModelConfig, n: int) -> int:
    """How many times each KV head is stored: ``n / kv_heads`` when ``kv_heads < n``, else 1."""
    return max(1, n // cfg.num_kv_heads)


def tp_model_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The config the sharded model computes with: KV heads repeated up to N (same attention)."""
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * kv_repeat(cfg, n))


def fuse_order(sizes: tuple[int, ...], n: int) -> np.ndarray:
    """Row order of a fused ``[sum(sizes), ...]`` weight: block s = every part's s-th N-th, side by side.

    *Semantics:* ``w[fuse_order(sizes, n)]`` split in N equal row blocks gives device s
    ``[part_0[s] | part_1[s] | ...]``; n = 1 is the identity.
    """
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    parts = zip(offsets, sizes, strict=True)
    local = [(int(o), size // n) for o, size in parts]
    return np.concatenate([np.arange(o + s * m, o + (s + 1) * m) for s in range(n) for o, m in local])


def _repeat_kv_rows(w: np.ndarray, cfg: ModelConfig, r: int) -> np.ndarray:
    """``[q+2kv, ...]`` fused q|k|v rows -> the same with each KV head's rows repeated r times."""
    if r == 1:
        return w
    q, kv, d = cfg.q_size, cfg.kv_size, cfg.head_dim
    k, v = (
        np.repeat(p.reshape(cfg.num_kv_heads, d, *w.shape[1:]), r, axis=0)
        for p in (w[q : q + kv], w[q + kv :])
    )
    return np.concatenate([w[:q], k.reshape(-1, *w.shape[1:]), v.reshape(-1, *w.shape[1:])])


def param_specs(cfg: ModelConfig, params: dict[str, Any], n: int) -> dict[str, Any]:
    """The PartitionSpec tree of ``params`` (same structure; leaves arrays or shape tuples) for N devices."""
    from loraserve.models.quantization import Int4Weight, Int8Weight

    vocab = P(AXIS, None) if cfg.vocab_size % n == 0 else P()
    top = {k: (vocab if k in ("embed", "lm_head") else P()) for k in params if k != "layers"}
    head = params.get("lm_head")
    if isinstance(head, Int8Weight | Int4Weight):  # a quantized head: values by vocab rows, scales with them
        split = vocab != P()
        scale = (P(AXIS) if split else P()) if isinstance(head, Int8Weight) else vocab
        top["lm_head"] = type(head)(vocab, scale)

    def layer_spec(key: str, value: Any) -> Any:
        dim = LAYER_SPLIT_DIM.get(key)
        if isinstance(value, Int8Weight):  # int8 values split like the weight, scales with their rows
            return Int8Weight(layer_spec(key, value.q), P(AXIS) if dim == 0 else P())
        if isinstance(value, Int4Weight):  # packed values split like the weight, scales with their groups
            check_int4_groups(key, np.shape(value.scale), n)
            return Int4Weight(layer_spec(key, value.q), P(AXIS, None) if dim == 0 else P(None, AXIS))
        rank = len(value) if isinstance(value, tuple) else np.ndim(value)  # a shape or an array
        return P(*(AXIS if d == dim else None for d in range(rank)))

    top["layers"] = [{k: layer_spec(k, v) for k, v in layer.items()} for layer in params["layers"]]
    return top


def shard_params(cfg: ModelConfig, params: dict[str, Any], mesh: Mesh, dtype: Any = None) -> dict[str, Any]:
    """Checkpoint params -> device arrays in the Megatron layout over ``mesh`` (fused rows re-ordered,
    KV heads repeated when fewer than N: :func:`layer_row_order`), each device's shard put straight from the
    host, so that no device ever holds a whole split tensor. Params still to be read
    (``checkpoint.open_checkpoint``'s ``Deferred``) are read shard by shard: each process reads only the rows
    and columns its own devices hold. Floats are placed in ``dtype`` (default: the embedding's)."""
    from loraserve.models.checkpoint import Deferred, is_deferred
    from loraserve.models.quantization import Quantized

    def deferred(v: Any, model_dtype: bool = True) -> Any:
        if isinstance(v, Quantized):
            return type(v)(deferred(v.q), deferred(v.scale, model_dtype=False))
        if is_deferred(v):
            return v
        a = np.asarray(v)
        return Deferred(a.shape, a.dtype, lambda rows, rest: a[rows][(slice(None), *rest)], model_dtype)

    params = jax.tree.map(deferred, params, is_leaf=lambda x: is_deferred(x) or isinstance(x, Quantized))
    if dtype is None:
        embed = params["embed"]
        dtype = embed.dtype if embed.dtype.kind == "f" else jnp.float32
    return _read_shards(cfg, params, mesh, jnp.dtype(dtype))


def layer_row_order(cfg: ModelConfig, key: str, rows: int, n: int) -> np.ndarray | None:
    """The N-device layout's rows of a layer param as rows of its checkpoint layout: ``wqkv``'s rows with
    each KV head's repeated ``kv_repeat`` times, then ``wqkv`` and ``w_gate_up`` (and their biases) in
    :func:`fuse_order`; None: the same rows. A quantized projection's scales follow their rows."""
    if key in ("wqkv", "bqkv"):
        tcfg = tp_model_config(cfg, n)
        order = fuse_order((tcfg.q_size, tcfg.kv_size, tcfg.kv_size), n)
        return _repeat_kv_rows(np.arange(rows), cfg, kv_repeat(cfg, n))[order]
    if key in ("w_gate_up", "b_gate_up"):
        return np.arange(rows)[fuse_order((cfg.intermediate_size,) * 2, n)]
    return None


def _read_shards(cfg: ModelConfig, params: dict[str, Any], mesh: Mesh, dtype: Any) -> dict[str, Any]:
    """:func:`shard_params` of ``Deferred`` params: every device's shard read by
    ``jax.make_array_from_callback`` (called for this process's devices only), each distinct shard once."""
    from loraserve.models.quantization import Quantized

    n = mesh.size

    def placed(d: Any, order: np.ndarray | None, spec: P) -> jax.Array:
        shape = (len(order) if order is not None else d.shape[0], *d.shape[1:])
        cast = dtype if jnp.issubdtype(d.dtype, jnp.floating) and d.model_dtype else d.dtype
        sharding = NamedSharding(mesh, spec)
        # this process's devices' shards read together, once: their rows (each checkpoint row once, even
        # when KV heads repeat) and the span of their other dimensions; each device's shard cut from it
        local = list(sharding.addressable_devices_indices_map(shape).values())
        rows = np.unique(np.concatenate([np.arange(shape[0])[index[0]] for index in local]))
        spans = [
            (min(i[k].indices(shape[k])[0] for i in local), max(i[k].indices(shape[k])[1] for i in local))
            for k in range(1, len(shape))
        ]
        source = rows if order is None else order[rows]
        unique, back = np.unique(source, return_inverse=True)
        block = d.read(unique, tuple(slice(a, b) for a, b in spans))[back.reshape(-1)].astype(cast)

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            at = np.searchsorted(rows, np.arange(shape[0])[index[0]])
            cut = [
                slice(s.indices(shape[k + 1])[0] - a, s.indices(shape[k + 1])[1] - a)
                for k, (s, (a, _)) in enumerate(zip(index[1:], spans, strict=True))
            ]
            return block[(at, *cut)]

        return jax.make_array_from_callback(shape, sharding, shard)

    def global_shape(d: Any, order: np.ndarray | None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((len(order) if order is not None else d.shape[0], *d.shape[1:]), d.dtype)

    # the N-device rows of each layer param as checkpoint rows (None: the same), computed once
    orders = [
        {k: layer_row_order(cfg, k, v.shape[0], n) for k, v in layer.items()} for layer in params["layers"]
    ]

    def top_shape(v: Any) -> Any:  # a quantized head (models.quantization) or a float tensor
        return (
            type(v)(global_shape(v.q, None), global_shape(v.scale, None))
            if isinstance(v, Quantized)
            else (global_shape(v, None))
        )

    shapes = {k: top_shape(v) for k, v in params.items() if k != "layers"}
    shapes["layers"] = [
        {
            k: type(v)(global_shape(v.q, rows[k]), global_shape(v.scale, rows[k]))
            if isinstance(v, Quantized)
            else global_shape(v, rows[k])
            for k, v in layer.items()
        }
        for layer, rows in zip(params["layers"], orders, strict=True)
    ]
    specs = param_specs(cfg, shapes, n)
    out = {
        k: type(v)(placed(v.q, None, specs[k].q), placed(v.scale, None, specs[k].scale))
        if isinstance(v, Quantized)
        else placed(v, None, specs[k])
        for k, v in params.items()
        if k != "layers"
    }
    out["layers"] = [
        {
            k: type(v)(placed(v.q, rows[k], spec[k].q), placed(v.scale, rows[k], spec[k].scale))
            if isinstance(v, Quantized)
            else placed(v, rows[k], spec[k])
            for k, v in layer.items()
        }
        for layer, rows, spec in zip(params["layers"], orders, specs["layers"], strict=True)
    ]
    return out


def check_int4_groups(key: str, scale_shape: tuple[int, ...], n: int) -> None:
    """A row-parallel int4 projection over N devices: each must hold whole groups of inputs (FailedPrecondition
    naming the projection otherwise; ``planner.check_int4_split`` refuses the same plan)."""
    if n > 1 and LAYER_SPLIT_DIM.get(key) == 1 and scale_shape[1] % n:
        raise FailedPrecondition(
            f"--quantization int4 over {n} devices: {key}'s {scale_shape[1]} groups of inputs do not split "
            f"into {n} equal shares"
        )


def pool_specs(cfg: ModelConfig, backend: ShardedBackend) -> dict[str, P]:
    """Pool name -> PartitionSpec: each pool split like the layer it adapts (``ShardedBackend.pool_spec``)."""
    out: dict[str, P] = {}
    for group, modules in cfg.lora_groups.items():
        out[f"A_{group}"] = backend.pool_spec("A", GROUP_PARALLEL[group])
        out.update({b_name(m): backend.pool_spec("B", GROUP_PARALLEL[group]) for m in modules})
        # models.lora.dora_bias's [S, out] vectors: split by output like a column-parallel layer's output, whole
        # for o/down (applied to the all-reduced output)
        vec = P(None, AXIS) if GROUP_PARALLEL[group] == COLUMN else P()
        out.update({scale_name(group): vec, bias_name(group): vec})
    # models.lora.embedding's vocabulary-sized pools (LoraPools.vocab): A_embed [S, V, R] split by vocab like the
    # embedding, B_lm_head [S, R, V] like lm_head (when N divides the vocabulary, else replicated, as the
    # weights are); B_embed and A_lm_head whole
    # a mixture of experts' pools (models.moe): expert-major [E, S, ...] split by expert like the experts;
    # the router's whole
    out.update({name: P(AXIS) for name in EXPERT_POOLS})
    out.update({name: P() for name in ROUTER_POOLS})
    split = cfg.vocab_size % backend.shards == 0
    out.update({name: P() for name in VOCAB_POOLS})
    if split:
        out.update(A_embed=P(None, AXIS, None), B_lm_head=P(None, None, AXIS))
    return out


def pool_shardings(cfg: ModelConfig, backend: ShardedBackend) -> dict[str, NamedSharding]:
    return {k: NamedSharding(backend.mesh, s) for k, s in pool_specs(cfg, backend).items()}


def expand_slot_values(
    cfg: ModelConfig, values: list[dict[str, np.ndarray]], n: int
) -> list[dict[str, np.ndarray]]:
    """One slot's canonical host values (``slots.slot_arrays`` of the checkpoint's config) -> the values
    for the N-device model: the k/v B columns repeated per KV head like the weights, and the fused
    ``models.lora.dora_bias`` vectors (k/v parts repeated the same way) in the device order of the fused weight
    rows (:func:`fuse_order`); no-op for N = 1."""
    if n == 1:
        return values
    r, d, tcfg = kv_repeat(cfg, n), cfg.head_dim, tp_model_config(cfg, n)
    order = {
        "qkv": fuse_order((tcfg.q_size, tcfg.kv_size, tcfg.kv_size), n),
        "gate_up": fuse_order((cfg.intermediate_size,) * 2, n),
    }

    def repeat_kv_columns(b: np.ndarray) -> np.ndarray:  # [R, kv*D] -> [R, kv*r*D]
        if r == 1:
            return b
        return np.repeat(b.reshape(b.shape[0], cfg.num_kv_heads, d), r, axis=1).reshape(b.shape[0], -1)

    def vector(key: str, v: np.ndarray) -> np.ndarray:  # fused [out] -> the device order of its weight's rows
        group = key.split("_", 1)[1].removeprefix("bias_")
        if group == "qkv":
            v = _repeat_kv_rows(v, cfg, r)
        return v[order[group]] if group in order else v

    def device_layout(k: str, v: np.ndarray) -> np.ndarray:
        if k in ("B_k", "B_v"):
            return repeat_kv_columns(v)
        return vector(k, v) if k.startswith(VECTOR_VALUES) else v

    return [{k: device_layout(k, v) for k, v in layer.items()} for layer in values]


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The shapes of ``models.checkpoint``'s params for ``cfg`` (one device's layout), as a params tree of
    tuples: what :func:`abstract_state` needs when no checkpoint is loaded (the capacity planner)."""
    h, q, kv, i, v = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    layer: dict[str, tuple[int, ...]] = {
        "attn_norm": (h,), "mlp_norm": (h,), "wqkv": (q + 2 * kv, h), "wo": (h, q),
        "w_gate_up": (2 * i, h), "w_down": (h, i),
    }  # fmt: skip
    if cfg.qkv_bias:
        layer["bqkv"] = (q + 2 * kv,)
    if cfg.o_bias:
        layer["bo"] = (h,)
    if cfg.mlp_bias:
        layer.update(b_gate_up=(2 * i,), b_down=(h,))
    if cfg.is_moe:  # models.checkpoint._experts: router and experts instead of the dense MLP
        e, m, shared = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_size
        del layer["w_gate_up"], layer["w_down"]
        layer.update(router=(e, h), experts_gate_up=(e, h, 2 * m), experts_down=(e, m, h))
        if shared:
            layer.update(shared_gate_up=(2 * shared, h), shared_down=(h, shared), shared_gate=(1, h))
    # the families' extra norms (Gemma's sandwich norms, Qwen3/Gemma 3's q/k norms), where the config has them
    if getattr(cfg, "sandwich_norms", False):
        layer.update(post_attn_norm=(h,), post_mlp_norm=(h,))
    if getattr(cfg, "qk_norm", False):
        layer.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    out: dict[str, Any] = {"embed": (v, h), "final_norm": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (v, h)
    out["layers"] = [dict(layer) for _ in range(cfg.num_layers)]
    return out


def abstract_state(
    cfg: ModelConfig,
    config: Any,
    mesh: Mesh,
    backend: LoraBackend,
    params: dict[str, Any] | None = None,
    platform: str | None = None,
    quantization: str = "none",
    quantize_lm_head: bool = False,
) -> dict[str, Any]:
    """Abstract params, KV cache and slot pools (``jax.ShapeDtypeStruct`` carrying their shardings) of the
    model ``cfg`` served with ``config`` (an ``EngineConfig``) over ``mesh``, for lowering the jitted
    decode/prefill ahead of time without allocating: ``jax.jit(f).lower(*abstract args)`` is one call.

    ``params``: a params tree whose leaves have shapes (real arrays or ``jax.eval_shape`` output) in the
    one-device layout; None = :func:`param_shapes` of ``cfg``. ``platform``: the one the state is for
    (None: JAX's default backend; it picks the KV cache's storage dtype, ``model.kv_storage_dtype``). Returns ``{"params", "cache", "pools",
    "model_config", "backend", "out_shardings"}``: the N-device model config and ``ShardedBackend`` the
    model is traced with, and the ``(token(s), cache)`` output shardings of the jitted steps.
    """
    n = mesh.size
    tcfg = tp_model_config(cfg, n)
    sharded = backend if isinstance(backend, ShardedBackend) else ShardedBackend(backend, mesh)
    dtype, pool_dtype = config.dtype, config.pool_dtype
    shapes = jax.tree.map(np.shape, params) if params is not None else param_shapes(cfg)

    def abstract(shape, dt, spec):
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dt), sharding=NamedSharding(mesh, spec))

    def tp_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if key in ("wqkv", "bqkv"):
            return (tcfg.q_size + 2 * tcfg.kv_size, *shape[1:])
        return tuple(shape)

    specs = param_specs(cfg, shapes, n)
    aparams: dict[str, Any] = {k: abstract(v, dtype, specs[k]) for k, v in shapes.items() if k != "layers"}
    aparams["layers"] = [
        {k: abstract(tp_shape(k, v), dtype, ls[k]) for k, v in layer.items()}
        for layer, ls in zip(shapes["layers"], specs["layers"], strict=True)
    ]
    if quantization != "none":  # models.quantization: the projections' values, and f32 scales split with them
        from loraserve.models.quantization import QUANTIZED, Int4Weight, Int8Weight, int4_group

        for layer in aparams["layers"]:
            for k in QUANTIZED:
                if k not in layer:
                    continue
                (out, inputs), spec = layer[k].shape, layer[k].sharding.spec
                by_rows = LAYER_SPLIT_DIM.get(k) == 0
                if quantization == "int8":
                    scale = abstract((out,), jnp.float32, P(AXIS) if by_rows and n > 1 else P())
                    layer[k] = Int8Weight(abstract((out, inputs), jnp.int8, spec), scale)
                    continue
                groups = (out, inputs // int4_group(inputs))
                check_int4_groups(k, groups, n)
                scale_spec = P() if n == 1 else (P(AXIS, None) if by_rows else P(None, AXIS))
                layer[k] = Int4Weight(
                    abstract((out, inputs // 2), jnp.uint8, spec), abstract(groups, jnp.float32, scale_spec)
                )
    if (
        quantize_lm_head
    ):  # models.checkpoint.quantized_head: by vocab rows like the float head, scales with them
        from loraserve.models.checkpoint import quantized_head

        vocab, hidden = shapes.get("lm_head", shapes["embed"])
        head = {"embed": jax.ShapeDtypeStruct((vocab, hidden), jnp.float32)}
        quantized_head(head, quantization)  # the quantized types and shapes, nothing read
        hs = param_specs(cfg, {"lm_head": head["lm_head"], "layers": []}, n)["lm_head"]
        aparams["lm_head"] = type(head["lm_head"])(
            abstract(head["lm_head"].q.shape, head["lm_head"].q.dtype, hs.q),
            abstract(head["lm_head"].scale.shape, jnp.float32, hs.scale),
        )
    pages = config.num_kv_pages(kv_page_bytes(cfg, config.kv_page_size, dtype))
    page_shape = (tcfg.num_kv_heads, pages, config.kv_page_size, tcfg.head_dim)
    stored = kv_storage_dtype(dtype, platform)
    cache = [
        (abstract(page_shape, stored, CACHE_SPEC), abstract(page_shape, stored, CACHE_SPEC))
        for _ in range(cfg.num_layers)
    ]
    pspecs = pool_specs(tcfg, sharded)
    slot = lora_slot_shapes(tcfg, config.max_lora_rank)
    vectors = {
        name(group): abstract((config.max_loras, size), VECTOR_DTYPE, pspecs[name(group)])
        for group, size in lora_vector_sizes(tcfg).items()
        for name in (scale_name, bias_name)
    }
    pools = [
        {
            **{
                k: abstract((config.max_loras, *sharded.slot_shape(s, pool_kind(k))), pool_dtype, pspecs[k])
                for k, s in slot.items()
            },
            **vectors,
            **{  # a mixture of experts' LoRA pools (models.moe), split by expert
                k: abstract(v.shape, pool_dtype, pspecs[k])
                for k, v in jax.eval_shape(
                    lambda: init_expert_pools(cfg, config.max_loras, config.max_lora_rank, pool_dtype)
                ).items()
            },
        }
        for _ in range(cfg.num_layers)
    ]
    vocab = {
        k: abstract((config.max_loras, *s), pool_dtype, pspecs[k])
        for k, s in vocab_slot_shapes(tcfg, config.max_lora_rank).items()
    }
    cache_out = [(NamedSharding(mesh, CACHE_SPEC),) * 2 for _ in range(cfg.num_layers)]
    return {
        "params": aparams, "cache": cache, "pools": LoraPools(pools, vocab), "model_config": tcfg, "backend": sharded,
        "out_shardings": (NamedSharding(mesh, P()), cache_out),
    }  # fmt: skip
