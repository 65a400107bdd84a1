"""``loraserve quantize SRC DST``: write a base checkpoint whose linear projections are already quantized.

Each decoder layer's ``q/k/v/o_proj`` and ``gate/up/down_proj`` weight (attention's only on a mixture of
experts, as ``--quantization`` does) becomes, with ``--quantization int8``, an ``I8`` tensor of the same
name and shape plus an ``F32`` ``<name>_scale [out]`` (``models.quantization.quantize_int8``: symmetric, per output
channel); with ``int4``, a ``U8`` tensor ``[out, in / 2]`` of packed int4 values plus an ``F32``
``<name>_scale [out, in / group]`` (``models.quantization.quantize_int4``: symmetric, a scale per group of inputs,
128 in released models' shapes: ``models.quantization.int4_group``). Every other tensor is copied as it is,
shard by shard (the index, if any, names the new scales), and ``config.json`` gains
``"quantization_config": {"quant_method": "loraserve-int8" | "loraserve-int4", ...}`` (``QUANT_METHODS``),
with which ``models.checkpoint.load_checkpoint`` takes the values and scales as they are instead of
quantizing at start-up. ``--lm-head`` quantizes ``lm_head.weight`` too (``"lm_head": true`` in that
``quantization_config``); a model that ties its head to the embedding keeps ``model.embed_tokens.weight`` as it is
and gains a quantized ``lm_head.weight`` (and its scale), which the worker serves as the head. Tokenizer and other files are copied. Local folders or fsspec URLs on both sides.
"""

from __future__ import annotations

import argparse
import json
import time

from loraserve.models.quantized_format import EMBED, HEAD, QUANT_METHODS, SCALE_SUFFIX, quantized_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src", help="a Hugging Face checkpoint folder (config.json + *.safetensors), path or URL"
    )
    parser.add_argument("dst", help="the folder to write (created; must not hold a checkpoint already)")
    parser.add_argument(
        "--quantization",
        choices=tuple(QUANT_METHODS),
        default="int8",
        help="what to write: int8 (a scale per output channel) or int4 (two a byte, a scale per 128 inputs)",
    )
    parser.add_argument(
        "--lm-head",
        action="store_true",
        help="quantize the head too (the worker's --quantize-lm-head); a model that ties it to its embedding"
        " keeps the embedding and gains a quantized lm_head.weight",
    )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    written = quantize_checkpoint(args.src, args.dst, args.quantization, lm_head=args.lm_head)
    seconds = time.perf_counter() - started
    print(
        f"wrote {args.dst}: {written['quantized']} {args.quantization} projections"
        f"{' (the head among them)' if args.lm_head else ''}, "
        f"{written['bytes'] / 1e6:.1f} MB in {seconds:.1f} s"
    )
    return 0


def quantize_checkpoint(
    src: str, dst: str, quantization: str = "int8", lm_head: bool = False
) -> dict[str, int]:
    """SRC -> DST as the module doc says (``lm_head``: the head too, written beside the embedding's shard for a
    tied model); returns counts (``quantized`` tensors, ``bytes`` written)."""
    from safetensors.numpy import save

    from loraserve.adapters.peft import safetensors_to_numpy
    from loraserve.common.errors import FailedPrecondition, InvalidArgument
    from loraserve.models.checkpoint import _open_folder, _weight_files, read_config
    from loraserve.models.config import ModelConfig
    from loraserve.models.quantization import INT4_GROUP, quantize_int4, quantize_int8

    if quantization not in QUANT_METHODS:
        raise InvalidArgument(f"quantization must be one of {', '.join(QUANT_METHODS)}, got {quantization!r}")
    method = QUANT_METHODS[quantization]

    config = read_config(src)
    ModelConfig.from_hf(config)  # a family the worker serves, or refused here
    if (config.get("quantization_config") or {}).get("quant_method"):
        raise FailedPrecondition(
            f"{src} is already quantized ({config['quantization_config']['quant_method']})"
        )
    sfs, sroot = _open_folder(src)
    dfs, droot = _open_folder(dst)
    if dfs.exists(f"{droot}/config.json"):
        raise InvalidArgument(f"{dst} already holds a checkpoint (config.json); choose an empty folder")
    dfs.makedirs(droot, exist_ok=True)
    files = _weight_files(sfs, sroot)
    weight_map: dict[str, str] = {}
    quantized = written = 0
    for path in files:
        name = path.rsplit("/", 1)[-1]
        with sfs.open(path, "rb") as f:
            tensors = safetensors_to_numpy(f.read())  # bf16 widened to f32 (exact)
        out = {}
        if lm_head and EMBED in tensors and config.get("tie_word_embeddings"):
            tensors[HEAD] = tensors[
                EMBED
            ]  # the tied head, quantized below beside the embedding kept as it is
        for key, value in tensors.items():
            if quantized_name(key, lm_head):
                q, scale = quantize_int4(value) if quantization == "int4" else quantize_int8(value)
                out[key], out[key + SCALE_SUFFIX] = q, scale
                quantized += 1
            else:
                out[key] = _original_dtype(value, config)
        data = save(out, metadata={"format": "pt", "quantization": method})
        with dfs.open(f"{droot}/{name}", "wb") as f:
            f.write(data)
        written += len(data)
        weight_map.update(dict.fromkeys(out, name))
    if sfs.exists(f"{sroot}/model.safetensors.index.json"):
        index = {"metadata": {"total_size": written}, "weight_map": weight_map}
        with dfs.open(f"{droot}/model.safetensors.index.json", "w") as f:
            json.dump(index, f, indent=2)
    config["quantization_config"] = {
        "quant_method": method, "symmetric": True, "scale_suffix": SCALE_SUFFIX, "lm_head": lm_head
    }  # fmt: skip
    if quantization == "int4":
        config["quantization_config"].update(
            bits=4, granularity="per_group", max_group_size=INT4_GROUP, packing="low_nibble_first"
        )
    else:
        config["quantization_config"].update(bits=8, granularity="per_output_channel")
    with dfs.open(f"{droot}/config.json", "w") as f:
        json.dump(config, f, indent=2)
    for other in sfs.ls(sroot, detail=False):  # tokenizer, generation config, chat template, ...
        base = str(other).rsplit("/", 1)[-1]
        if base == "config.json" or base.endswith(".safetensors") or base == "model.safetensors.index.json":
            continue
        if sfs.isfile(other):
            with sfs.open(other, "rb") as f, dfs.open(f"{droot}/{base}", "wb") as g:
                g.write(f.read())
    return {"quantized": quantized, "bytes": written}


def _original_dtype(value, config):
    """A copied tensor in the checkpoint's dtype (safetensors_to_numpy widened bf16 to f32)."""
    import numpy as np

    if config.get("torch_dtype", config.get("dtype")) == "bfloat16" and value.dtype == np.float32:
        import ml_dtypes

        return value.astype(ml_dtypes.bfloat16)
    return value
