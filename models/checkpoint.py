"""Load a Hugging Face Llama-family (Llama, Mistral, Qwen2/3, Gemma 2/3 text, and the mixture-of-experts
Qwen3-MoE, Mixtral, Qwen2-MoE) checkpoint folder (local path or fsspec URL) into JAX arrays.

The folder holds ``config.json`` and one or many ``*.safetensors`` (sharded checkpoints carry a
``model.safetensors.index.json``). Matrices stay in Hugging Face's ``[out, in]`` layout, one dict per layer
(see ``models.decoder`` for why not stacked), and q/k/v and gate/up are fused into one matmul each.

Nothing is read whole. :func:`open_checkpoint` reads the files' safetensors headers only and returns each
parameter as a :class:`Deferred`: its shape and how to read any rows and column ranges of it, byte ranges
straight from the files (:class:`TensorFiles`). :func:`load_checkpoint` reads them all, one tensor at a time
(the host never holds the whole model in f32); a model split over devices (``sharding.shard_params``) reads
only the rows and columns each of this process's devices holds, so the hosts of a multi-host worker each read
their share of the checkpoint, not all of it.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from loraserve.common.errors import FailedPrecondition, InvalidArgument
from loraserve.models.config import ModelConfig
from loraserve.models.quantization import (
    QUANTIZATIONS,
    QUANTIZED,
    Int4Weight,
    Int8Weight,
    Quantized,
    int4_group,
    quantize_int4,
    quantize_int8,
)
from loraserve.models.quantized_format import HEAD, QUANT_METHODS, SCALE_SUFFIX, quantized_name

Params = dict[str, Any]
Rest = tuple[slice, ...]  # slices of a parameter's dimensions after the first


class CheckpointError(InvalidArgument, ValueError):
    """The checkpoint folder is missing files or tensors, or they have the wrong shape (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Checkpoint:
    """A base model: its config, its parameters and where it came from. ``params`` leaves are device (or
    host) arrays from :func:`load_checkpoint`, :class:`Deferred` reads from :func:`open_checkpoint`;
    ``files`` counts the bytes read from the checkpoint."""

    config: ModelConfig
    params: Params
    source: str
    dtype: str
    quantization: str = "none"  # models.quantization: "int8" = the projections are Int8Weights
    files: TensorFiles | None = field(default=None, compare=False, repr=False)

    @property
    def quantized_head(self) -> bool:
        """The head is quantized too (``--quantize-lm-head``, or a checkpoint written with it)."""

        return isinstance(self.params.get("lm_head"), Quantized)


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


# ------------------------------------------------------------------------------------- reading files

# safetensors dtype -> how its bytes read; BF16 is widened to float32 (exact: a bf16 is an f32's top half)
_STORED = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2"}
_STORED |= {"I8": "i1", "U8": "u1", "BOOL": "?"}
MAX_HEADER = 100 << 20  # a safetensors header larger than this is refused, not read
# byte ranges this close are read as one, up to MAX_BLOCK: from object storage (a request costs more than
# reading through the gap), and from a local disk (a page)
REMOTE_GAP, LOCAL_GAP = 256 << 10, 4 << 10
MAX_BLOCK = 64 << 20


@dataclass(frozen=True)
class Stored:
    """One tensor of a safetensors file: where its bytes start and how they read."""

    path: str
    dtype: str  # the safetensors name: "BF16", "F32", "I8", ...
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file

    @property
    def itemsize(self) -> int:
        return np.dtype(_STORED[self.dtype]).itemsize


class TensorFiles:
    """The safetensors files of a checkpoint folder, read by rows and column ranges (byte-range reads,
    through fsspec: a local folder, GCS, memory). ``bytes_read`` counts what was read, ``total_bytes`` the
    tensors' bytes in all."""

    def __init__(self, url: str) -> None:
        self.fs, root = _open_folder(url)
        self.url, self.local = url, isinstance(self.fs, LocalFileSystem)
        self.tensors: dict[str, Stored] = {}
        for path in _weight_files(self.fs, root):
            self.tensors.update(self._header(path))
        self.total_bytes = sum(s.itemsize * math.prod(s.shape) for s in self.tensors.values())
        self.bytes_read = 0
        self._lock = threading.Lock()

    def _header(self, path: str) -> dict[str, Stored]:
        name = path.rsplit("/", 1)[-1]
        size = self.fs.size(path)
        with self.fs.open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(MAX_HEADER, size - 8):
                raise CheckpointError(
                    f"{name} is not a safetensors file (header length {n}, file {size} bytes)"
                )
            try:
                header = json.loads(f.read(n))
            except ValueError as exc:
                raise CheckpointError(f"{name} is not a safetensors file: its header is not JSON") from exc
        out = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = (
                    info["dtype"],
                    tuple(int(d) for d in info["shape"]),
                    info["data_offsets"],
                )
            except (TypeError, KeyError, ValueError) as exc:
                raise CheckpointError(f"{name}: tensor {key}'s header entry is malformed") from exc
            if dtype not in _STORED:
                raise CheckpointError(f"tensor {key} has dtype {dtype}, which is not served")
            stored = Stored(path, dtype, shape, 8 + n + int(begin))
            bad = min(shape, default=0) < 0 or not 0 <= int(begin) <= int(end)
            if bad or int(end) - int(begin) != stored.itemsize * math.prod(shape) or 8 + n + int(end) > size:
                raise CheckpointError(
                    f"{name}: tensor {key}'s bytes do not match its shape {shape} and dtype"
                )
            out[key] = stored
        return out

    def has(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, rows: np.ndarray | None = None, cols: slice | None = None) -> np.ndarray:
        """Tensor ``name``'s ``rows`` (of its first dimension; all when None), with ``cols`` of its second
        (a 2-d tensor); floats as float32, integers as they are stored."""
        s = self.tensors[name]
        shape = s.shape or (1,)
        rows = np.arange(shape[0]) if rows is None else np.asarray(rows, np.int64).reshape(-1)
        row_items = math.prod(shape[1:])
        width = (0, row_items)
        if cols is not None and len(shape) == 2:
            c0, c1, step = cols.indices(shape[1])
            assert step == 1, "column ranges only"
            width = (c0, c1)
        item = s.itemsize
        if width == (0, row_items):  # whole rows: one range per run of consecutive rows
            breaks = np.flatnonzero(np.diff(rows) != 1) + 1
            runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(rows, breaks) if len(r)]
            ranges = [(s.offset + a * row_items * item, s.offset + b * row_items * item) for a, b in runs]
        else:
            ranges = [
                (
                    s.offset + (int(r) * row_items + width[0]) * item,
                    s.offset + (int(r) * row_items + width[1]) * item,
                )
                for r in rows
            ]
        data = self._ranges(s.path, ranges)
        values = np.frombuffer(data, _STORED[s.dtype])
        if s.dtype == "BF16":
            values = (values.astype("<u4") << 16).view("<f4")
        elif values.dtype.kind == "f":
            values = values.astype(np.float32)
        out_shape = (len(rows), width[1] - width[0]) if width != (0, row_items) else (len(rows), *shape[1:])
        return values.reshape(out_shape if s.shape else ())

    def _ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> bytes | bytearray:
        """The bytes of ``ranges`` (in their order), read in blocks that join ranges closer than
        LOCAL_GAP (a local file) or REMOTE_GAP (object storage)."""
        if not ranges:
            return b""
        gap = LOCAL_GAP if self.local else REMOTE_GAP
        blocks: list[list[int]] = []
        for a, b in sorted(set(ranges)):
            if blocks and a - blocks[-1][1] <= gap and b - blocks[-1][0] <= MAX_BLOCK:
                blocks[-1][1] = max(blocks[-1][1], b)
            else:
                blocks.append([a, b])
        if self.local:  # one open file, a seek a block
            got = []
            with open(path, "rb") as f:
                for a, b in blocks:
                    f.seek(a)
                    got.append((a, f.read(b - a)))
        else:  # a request a block (object stores fetch them concurrently), no read-ahead past it
            data = self.fs.cat_ranges([path] * len(blocks), [a for a, _ in blocks], [b for _, b in blocks])
            got = [(a, bytes(d)) for (a, _), d in zip(blocks, data, strict=True)]
        with self._lock:
            self.bytes_read += sum(len(d) for _, d in got)
        if len(ranges) == 1 and len(got) == 1:  # a whole tensor or one run of rows: the block itself
            return got[0][1]
        starts = [a for a, _ in got]
        views = [memoryview(data) for _, data in got]
        out, at = bytearray(sum(b - a for a, b in ranges)), 0  # each byte copied once
        for a, b in ranges:
            k = int(np.searchsorted(starts, a, side="right")) - 1
            out[at : at + b - a] = views[k][a - got[k][0] : b - got[k][0]]
            at += b - a
        return out


# ------------------------------------------------------------------------------------- deferred params


@dataclass(frozen=True)
class Deferred:
    """A parameter of the loaded layout, not read yet: its shape, the numpy dtype it reads as, and
    ``read(rows, rest)``: the values at ``rows`` (an index array into the first dimension) and ``rest``
    (slices of the others)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    reader: Callable[[np.ndarray, Rest], np.ndarray] = field(repr=False)
    model_dtype: bool = True  # floats placed in the model's dtype; False: kept as read (quantization scales)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def read(self, rows: np.ndarray | None = None, rest: Rest = ()) -> np.ndarray:
        rows = np.arange(self.shape[0]) if rows is None else np.asarray(rows, np.int64)
        return self.reader(rows, tuple(rest))


def _tail(values: np.ndarray, rest: Rest) -> np.ndarray:
    return values[(slice(None), *rest)] if rest else values


def _tensor(files: TensorFiles, name: str, shape: tuple[int, ...]) -> Deferred:
    """One stored tensor, checked to exist with ``shape``."""
    if not files.has(name):
        raise CheckpointError(f"checkpoint lacks tensor {name}")
    s = files.tensors[name]
    if s.shape != shape:
        raise CheckpointError(f"tensor {name} has shape {s.shape}, expected {shape}")
    kind = np.dtype(_STORED[s.dtype])
    dtype = np.dtype(np.float32) if s.dtype == "BF16" or kind.kind == "f" else kind

    def read(rows: np.ndarray, rest: Rest) -> np.ndarray:
        if len(shape) == 2 and rest:
            return files.read(name, rows, rest[0])
        return _tail(files.read(name, rows), rest)

    return Deferred(shape, dtype, read)


def _concat(parts: Sequence[Deferred]) -> Deferred:
    """``parts`` side by side along the first dimension (q|k|v rows, gate|up rows)."""
    if len(parts) == 1:
        return parts[0]
    bounds = np.cumsum([0] + [p.shape[0] for p in parts])
    shape = (int(bounds[-1]), *parts[0].shape[1:])

    def read(rows: np.ndarray, rest: Rest) -> np.ndarray:
        which = np.searchsorted(bounds, rows, side="right") - 1
        pieces, where = [], []
        for k, part in enumerate(parts):
            mine = np.flatnonzero(which == k)
            if len(mine):
                pieces.append(part.read(rows[mine] - bounds[k], rest))
                where.append(mine)
        if len(pieces) == 1:
            return pieces[0]
        out = np.empty((len(rows), *pieces[0].shape[1:]), pieces[0].dtype)
        for mine, piece in zip(where, pieces, strict=True):
            out[mine] = piece
        return out

    return Deferred(shape, parts[0].dtype, read)


def _rows(parts: Sequence[Any]) -> Any:
    """:func:`_concat`, of quantized weights too (values and scales side by side, row for row)."""

    if isinstance(parts[0], Quantized):
        return type(parts[0])(_concat([p.q for p in parts]), _concat([p.scale for p in parts]))
    return _concat(parts)


def _experts_t(per_expert: Sequence[Deferred] | None, fused: Deferred | None) -> Deferred:
    """Experts ``[E, a, b]`` stored ``[E, b, a]`` (fused) or as E ``[b, a]`` tensors: transposed to ``[E, a, b]``
    (input-major per expert), read by expert."""
    src = fused.shape[1:] if fused is not None else per_expert[0].shape
    e = fused.shape[0] if fused is not None else len(per_expert)

    def read(rows: np.ndarray, rest: Rest) -> np.ndarray:
        if fused is not None:
            values = fused.read(rows)
        else:
            values = np.stack([per_expert[int(r)].read() for r in rows]) if len(rows) else np.empty((0, *src))
        return _tail(np.ascontiguousarray(values.transpose(0, 2, 1)), rest)

    return Deferred((e, src[1], src[0]), np.dtype(np.float32), read)


def is_deferred(x: Any) -> bool:
    return isinstance(x, Deferred)


def plan_params(
    cfg: ModelConfig,
    files: TensorFiles,
    projection: Callable[[str, tuple[int, int]], Any] | None = None,
    float_head: bool = True,
) -> Params:
    """The checkpoint's tensors -> our layout as :class:`Deferred` params (``[out, in]`` matrices, fused
    q|k|v and gate|up, ``layers``: one dict per layer), every tensor checked to exist with its shape;
    ``projection(name, (out, in))`` reads a layer's linear weight where it is not a float tensor (a quantized
    checkpoint's values and scales); ``float_head`` False: no ``lm_head`` (the caller reads a quantized one)."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size

    def t(name: str, shape: tuple[int, ...]) -> Deferred:
        return _tensor(files, name, shape)

    w = projection or t

    out: Params = {"embed": t("model.embed_tokens.weight", (cfg.vocab_size, h))}
    out["final_norm"] = t("model.norm.weight", (h,))
    if float_head and files.has("lm_head.weight") and not cfg.tie_word_embeddings:
        out["lm_head"] = t("lm_head.weight", (cfg.vocab_size, h))
    layers = []
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        layer = {"attn_norm": t(p + "input_layernorm.weight", (h,))}
        if cfg.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention output
            layer["post_attn_norm"] = t(p + "post_attention_layernorm.weight", (h,))
            layer["mlp_norm"] = t(p + "pre_feedforward_layernorm.weight", (h,))
            layer["post_mlp_norm"] = t(p + "post_feedforward_layernorm.weight", (h,))
        else:
            layer["mlp_norm"] = t(p + "post_attention_layernorm.weight", (h,))
        if cfg.qk_norm:
            layer["q_norm"] = t(p + "self_attn.q_norm.weight", (cfg.head_dim,))
            layer["k_norm"] = t(p + "self_attn.k_norm.weight", (cfg.head_dim,))
        a = p + "self_attn."
        layer["wqkv"] = _rows(
            [w(a + "q_proj.weight", (q, h)), w(a + "k_proj.weight", (kv, h)), w(a + "v_proj.weight", (kv, h))]
        )
        if cfg.qkv_bias:
            layer["bqkv"] = _concat(
                [t(a + "q_proj.bias", (q,)), t(a + "k_proj.bias", (kv,)), t(a + "v_proj.bias", (kv,))]
            )
        layer["wo"] = w(a + "o_proj.weight", (h, q))
        if cfg.o_bias:
            layer["bo"] = t(a + "o_proj.bias", (h,))
        if cfg.is_moe:
            layer.update(_experts(cfg, files, p))
        else:
            m = p + "mlp."
            layer["w_gate_up"] = _rows([w(m + "gate_proj.weight", (i, h)), w(m + "up_proj.weight", (i, h))])
            layer["w_down"] = w(m + "down_proj.weight", (h, i))
            if cfg.mlp_bias:
                layer["b_gate_up"] = _concat([t(m + "gate_proj.bias", (i,)), t(m + "up_proj.bias", (i,))])
                layer["b_down"] = t(m + "down_proj.bias", (h,))
        layers.append(layer)
    out["layers"] = layers
    return out


def _experts(cfg: ModelConfig, files: TensorFiles, p: str) -> dict[str, Deferred]:
    """One sparse layer's router and experts (and shared expert): ``router [E, H]``, ``experts_gate_up
    [E, H, 2I]`` and ``experts_down [E, I, H]`` (input-major per expert: the grouped matmul's right-hand
    side), ``shared_gate_up``/``shared_down``/``shared_gate [1, H]`` for Qwen2-MoE's shared expert.

    Both layouts: transformers 5.x's fused ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``,
    and the per-expert modules before it (``mlp.experts.<e>.{gate,up,down}_proj``; Mixtral's
    ``block_sparse_moe.experts.<e>.{w1,w3,w2}`` and ``block_sparse_moe.gate``).
    """
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size

    def t(name: str, shape: tuple[int, ...]) -> Deferred:
        return _tensor(files, name, shape)

    out: dict[str, Deferred] = {}
    block = p + ("mlp." if files.has(p + "mlp.gate.weight") else "block_sparse_moe.")
    out["router"] = t(block + "gate.weight", (e, h))
    if files.has(block + "experts.gate_up_proj"):
        out["experts_gate_up"] = _experts_t(None, t(block + "experts.gate_up_proj", (e, 2 * i, h)))
        out["experts_down"] = _experts_t(None, t(block + "experts.down_proj", (e, h, i)))
    else:
        names = (
            ("w1", "w3", "w2")
            if block.endswith("block_sparse_moe.")
            else ("gate_proj", "up_proj", "down_proj")
        )
        per = [block + f"experts.{x}." for x in range(e)]
        gate_up = [
            _concat([t(q + f"{names[0]}.weight", (i, h)), t(q + f"{names[1]}.weight", (i, h))]) for q in per
        ]
        out["experts_gate_up"] = _experts_t(gate_up, None)
        out["experts_down"] = _experts_t([t(q + f"{names[2]}.weight", (h, i)) for q in per], None)
    if cfg.shared_expert_size:
        s, q = cfg.shared_expert_size, block + "shared_expert."
        out["shared_gate_up"] = _concat([t(q + "gate_proj.weight", (s, h)), t(q + "up_proj.weight", (s, h))])
        out["shared_down"] = t(q + "down_proj.weight", (h, s))
        out["shared_gate"] = t(block + "shared_expert_gate.weight", (1, h))
    return out


def open_checkpoint(
    url: str, dtype: str = "float32", quantization: str = "none", quantize_lm_head: bool = False
) -> Checkpoint:
    """The checkpoint at ``url`` with its params :class:`Deferred` (nothing read but the headers and, of a
    ``loraserve quantize`` checkpoint, the scales, which are checked); quantization as :func:`load_checkpoint`."""

    if quantization not in QUANTIZATIONS:
        raise InvalidArgument(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    hf_config = read_config(url)
    cfg = ModelConfig.from_hf(hf_config)
    files = TensorFiles(url)
    written = _prequantized(hf_config)
    if written:
        head = bool((hf_config.get("quantization_config") or {}).get("lm_head"))
        params, quantization = _plan_prequantized(cfg, files, written, head), written
    else:
        params = plan_params(cfg, files)
        if quantization != "none":
            for layer in params["layers"]:
                for key in QUANTIZED:
                    if key in layer:
                        layer[key] = deferred_quantized(layer[key], quantization)
    if quantize_lm_head:
        quantized_head(params, quantization)
    jdtype = jnp.dtype(dtype)
    return Checkpoint(cfg, params, url, jdtype.name, quantization, files)


def load_checkpoint(
    url: str,
    dtype: str = "float32",
    quantization: str = "none",
    place: bool = True,
    quantize_lm_head: bool = False,
) -> Checkpoint:
    """Read ``config.json`` + safetensors from ``url`` and place the weights on the device (``place`` False:
    keep them host arrays of ``dtype``), one tensor at a time;
    ``quantization="int8"`` stores the layers' projections as int8 with per-channel scales, ``"int4"`` as
    packed int4 with a scale per group of inputs (models.quantization). A checkpoint ``loraserve quantize`` wrote
    (``worker.quantize_cmd``) is served as it was written whatever ``quantization`` says: its values and
    scales are taken as they are (checked: every scale present, of its shape, finite and positive), not
    quantized again. ``quantize_lm_head`` quantizes the head as well (:func:`quantized_head`). A
    model split over devices is opened with :func:`open_checkpoint` instead, which reads
    nothing until ``sharding.shard_params`` reads each device's shard.

    Semantics: the returned params compute exactly what transformers' ``*ForCausalLM`` of the family computes
    (quantized: what it computes with those weights dequantized).
    """
    checkpoint = open_checkpoint(url, dtype, quantization, quantize_lm_head)
    params = read_params(checkpoint, jax.device_put if place else _host)
    return Checkpoint(
        checkpoint.config, params, url, checkpoint.dtype, checkpoint.quantization, checkpoint.files
    )


def read_params(checkpoint: Checkpoint, put: Callable[[Any], Any] = jax.device_put) -> Params:
    """Every :class:`Deferred` param of ``checkpoint`` read whole, in the model's dtype, through ``put``
    (one tensor at a time); params already read are put as they are."""
    jdtype = jnp.dtype(checkpoint.dtype)

    def leaf(value: Any) -> Any:
        if not isinstance(value, Deferred):
            return put(value)
        values = value.read()
        return put(values.astype(jdtype) if value.dtype.kind == "f" and value.model_dtype else values)

    return jax.tree.map(leaf, checkpoint.params, is_leaf=is_deferred)


def _host(value: np.ndarray) -> np.ndarray:
    """``load_checkpoint(place=False)``'s stand-in for ``jax.device_put``."""
    return value


def _prequantized(hf_config: dict[str, Any]) -> str:
    """The quantization ("int8" | "int4") ``config.json`` says ``loraserve quantize`` wrote, "" for an
    unquantized checkpoint; another method is refused."""

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


def _plan_prequantized(cfg: ModelConfig, files: TensorFiles, quantization: str, head: bool = False) -> Params:
    """A ``loraserve quantize`` checkpoint: each projection's int8 (or packed int4) values with their
    ``_scale`` (checked and named when wrong: every scale is read here, a small share of the bytes), fused as
    the float weights are (rows side by side, each row's scales with it); ``head`` (written with ``--lm-head``):
    ``lm_head.weight`` too, served as the head even where the model ties it to the embedding; the rest as any
    checkpoint."""

    int4 = quantization == "int4"
    stored = "U8" if int4 else "I8"
    if head and not files.has(HEAD):
        raise CheckpointError(f"checkpoint lacks tensor {HEAD} (its config says the head is quantized)")
    for name in [k for k in files.tensors if quantized_name(k, head)]:
        q = files.tensors[name]
        if q.dtype != stored or len(q.shape) != 2:
            dtype = "bfloat16" if q.dtype == "BF16" else np.dtype(_STORED[q.dtype]).name
            raise CheckpointError(
                f"tensor {name} is {dtype} of shape {q.shape}; an {quantization} checkpoint stores it as a "
                f"2-d {np.dtype(_STORED[stored]).name} matrix"
            )
        if not files.has(name + SCALE_SUFFIX):
            raise CheckpointError(f"checkpoint lacks tensor {name + SCALE_SUFFIX} (the scales of {name})")
        scale = files.tensors[name + SCALE_SUFFIX]
        inputs = 2 * q.shape[1] if int4 else q.shape[1]
        want = (q.shape[0], inputs // int4_group(inputs)) if int4 else (q.shape[0],)
        if scale.shape != want:
            packed = f" for {name} {q.shape} (packed: {inputs} inputs)" if int4 else ""
            raise CheckpointError(
                f"tensor {name + SCALE_SUFFIX} has shape {scale.shape}, expected {want}{packed}"
            )
        values = files.read(name + SCALE_SUFFIX)
        if not (np.isfinite(values).all() and (values > 0).all()):
            raise CheckpointError(
                f"tensor {name + SCALE_SUFFIX} holds a scale that is not finite and positive"
            )
    bases = {k: k[: -len(SCALE_SUFFIX)] for k in files.tensors if k.endswith(SCALE_SUFFIX)}
    stray = sorted(k for k, base in bases.items() if not (quantized_name(base, head) and files.has(base)))
    if stray:
        raise CheckpointError(f"tensor {stray[0]} scales no {quantization} projection of this checkpoint")

    def projection(name: str, shape: tuple[int, int]) -> Any:
        out, inputs = shape
        if not files.has(name):
            raise CheckpointError(f"checkpoint lacks tensor {name}")
        if int4:
            values = _tensor(files, name, (out, inputs // 2))
            scale = _tensor(files, name + SCALE_SUFFIX, (out, inputs // int4_group(inputs)))
            weight: Any = Int4Weight(values, scale)
        else:
            weight = Int8Weight(_tensor(files, name, shape), _tensor(files, name + SCALE_SUFFIX, (out,)))
        return type(weight)(weight.q, _unscaled(weight.scale))

    params = plan_params(cfg, files, projection, float_head=not head)
    if head:
        params["lm_head"] = projection(HEAD, (cfg.vocab_size, cfg.hidden_size))
    return params


def _unscaled(d: Deferred) -> Deferred:
    """``d`` kept in float32 whatever the model's dtype (quantization scales)."""
    return Deferred(d.shape, d.dtype, d.reader, model_dtype=False)


# ------------------------------------------------------------- quantized at load: read, then quantize


def quantized_head(params: dict[str, Any], quantization: str) -> None:
    """``params["lm_head"]`` (still to be read) as ``quantization`` weights, in place; a tied model's head from
    its embedding (which stays as it is, for the lookup)."""
    if quantization not in ("int8", "int4"):
        raise FailedPrecondition(
            f"--quantize-lm-head needs --quantization int8 or int4, got {quantization!r}"
        )
    head = params.get("lm_head", params["embed"])
    if not isinstance(head, Quantized):  # a `loraserve quantize --lm-head` checkpoint's head is already
        params["lm_head"] = deferred_quantized(head, quantization)


def deferred_quantized(src: Any, quantization: str) -> Quantized:
    """A float ``[out, in]`` weight still to be read (``models.checkpoint.Deferred``) as ``quantization``
    weights still to be read: each read of values or scales reads the float rows it needs (int8: whole rows,
    its scale is the row's maximum; int4: the groups the columns asked for) and quantizes them, exactly as
    ``quantize_int8`` / ``quantize_int4`` quantize the whole weight. Values and scales of the same rows are
    quantized once."""
    out, inputs = src.shape
    int4 = quantization == "int4"
    group = int4_group(inputs) if int4 else inputs
    memo: dict[tuple[bytes, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def quantized(rows: np.ndarray, g0: int, g1: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``rows``' groups g0..g1 (int8: the one group of the whole row) quantized."""
        key = (rows.tobytes(), g0, g1)
        if key not in memo:
            if len(memo) > 8:
                memo.clear()
            floats = src.read(rows, (slice(g0 * group, g1 * group),))
            memo[key] = quantize_int4(floats, group) if int4 else quantize_int8(floats)
        return memo[key]

    def groups(cols: slice, per_group: int, width: int) -> tuple[int, int, slice]:
        c0, c1, _ = cols.indices(width)
        g0, g1 = c0 // per_group, -(-c1 // per_group)
        return g0, g1, slice(c0 - g0 * per_group, c1 - g0 * per_group)

    if int4:
        packed, n_groups = inputs // 2, inputs // group

        def read_q(rows: np.ndarray, rest: tuple[slice, ...]) -> np.ndarray:
            g0, g1, local = groups(rest[0] if rest else slice(None), group // 2, packed)
            return quantized(rows, g0, g1)[0][:, local]

        def read_scale(rows: np.ndarray, rest: tuple[slice, ...]) -> np.ndarray:
            g0, g1, local = groups(rest[0] if rest else slice(None), 1, n_groups)
            return quantized(rows, g0, g1)[1][:, local]

        return Int4Weight(
            Deferred((out, packed), np.dtype(np.uint8), read_q),
            Deferred((out, n_groups), np.dtype(np.float32), read_scale, model_dtype=False),
        )

    def read_q8(rows: np.ndarray, rest: tuple[slice, ...]) -> np.ndarray:
        values = quantized(rows, 0, 1)[0]
        return values[:, rest[0]] if rest else values

    def read_scale8(rows: np.ndarray, rest: tuple[slice, ...]) -> np.ndarray:
        return quantized(rows, 0, 1)[1]

    return Int8Weight(
        Deferred((out, inputs), np.dtype(np.int8), read_q8),
        Deferred((out,), np.dtype(np.float32), read_scale8, model_dtype=False),
    )
