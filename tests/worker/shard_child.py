"""Child of ``test_shard_reads`` (forced host devices, JSON on stdout): for each case, a checkpoint opened
without reading (``open_checkpoint``) and split over N devices by ``sharding.shard_params`` (each device's
shard read from the files) against the whole checkpoint read and laid out for N devices on the host by
:func:`reference_layout`, written here from the layout's definition (docs/worker.md), leaf by leaf, bit
for bit, with each leaf's PartitionSpec."""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np


def reference_layout(cfg: Any, layer: dict[str, Any], n: int) -> dict[str, Any]:
    """One layer's host params -> the N-device layout: every KV head's rows of ``wqkv`` (and ``bqkv``)
    repeated N / kv_heads times when there are fewer KV heads than devices; then the rows of the fused
    ``wqkv`` and ``w_gate_up`` (and biases) in blocks, block s = each part's s-th N-th side by side; a
    quantized projection's scales moved with their rows."""
    from loraserve.models.quantization import Quantized

    r = max(1, n // cfg.num_kv_heads)
    d, kvh = cfg.head_dim, cfg.num_kv_heads

    def repeat_kv(w: np.ndarray) -> np.ndarray:
        q, kv = cfg.q_size, cfg.kv_size
        k = np.repeat(w[q : q + kv].reshape(kvh, d, *w.shape[1:]), r, axis=0).reshape(-1, *w.shape[1:])
        v = np.repeat(w[q + kv :].reshape(kvh, d, *w.shape[1:]), r, axis=0).reshape(-1, *w.shape[1:])
        return np.concatenate([w[:q], k, v])

    def blocks(w: np.ndarray, sizes: list[int]) -> np.ndarray:
        parts = np.split(w, np.cumsum(sizes)[:-1])
        return np.concatenate([p[s * len(p) // n : (s + 1) * len(p) // n] for s in range(n) for p in parts])

    def rows(v: Any, fn: Any) -> Any:
        return (
            type(v)(fn(np.asarray(v.q)), fn(np.asarray(v.scale)))
            if isinstance(v, Quantized)
            else fn(np.asarray(v))
        )

    out = {}
    for key, v in layer.items():
        if key in ("wqkv", "bqkv"):
            sizes = [cfg.q_size, cfg.kv_size * r, cfg.kv_size * r]
            out[key] = rows(v, lambda w, sizes=sizes: blocks(repeat_kv(w), sizes))
        elif key in ("w_gate_up", "b_gate_up"):
            out[key] = rows(v, lambda w: blocks(w, [cfg.intermediate_size] * 2))
        else:
            out[key] = rows(v, lambda w: w)
    return out


def check(path: str, n: int, dtype: str, quantization: str) -> list[str]:
    import jax

    from loraserve.models import sharding
    from loraserve.models.checkpoint import load_checkpoint, open_checkpoint
    from loraserve.models.quantization import Quantized

    quantization, _, head = quantization.partition("+")  # "int8+head": --quantize-lm-head too
    whole = load_checkpoint(path, dtype, quantization, place=False, quantize_lm_head=head == "head")
    opened = open_checkpoint(path, dtype, quantization, quantize_lm_head=head == "head")
    cfg = whole.config
    mesh = sharding.make_mesh(n)
    placed = sharding.shard_params(cfg, opened.params, mesh, opened.dtype)
    want = {k: v for k, v in whole.params.items() if k != "layers"}
    want["layers"] = [reference_layout(cfg, layer, n) for layer in whole.params["layers"]]
    specs = sharding.param_specs(cfg, want, n)
    problems = []
    flat_want = jax.tree_util.tree_flatten_with_path(want, is_leaf=lambda x: isinstance(x, Quantized))[0]
    got = jax.tree.leaves(placed, is_leaf=lambda x: isinstance(x, Quantized))
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, Quantized))
    for (where, expected), array, spec in zip(flat_want, got, spec_leaves, strict=True):
        pairs = (
            [(expected.q, array.q, spec.q), (expected.scale, array.scale, spec.scale)]
            if isinstance(expected, Quantized)
            else [(expected, array, spec)]
        )
        for e, a, s in pairs:
            e = np.asarray(e)
            if a.sharding.spec != s:
                problems.append(f"{jax.tree_util.keystr(where)}: spec {a.sharding.spec} != {s}")
            if np.asarray(a).dtype != e.dtype or not np.array_equal(np.asarray(a), e):
                problems.append(
                    f"{jax.tree_util.keystr(where)}: values differ ({np.asarray(a).dtype} vs {e.dtype})"
                )
    if opened.files.bytes_read == 0:
        problems.append("nothing was read")
    return problems


def main() -> None:
    cases = json.loads(sys.argv[1])
    print(
        json.dumps(
            {f"{c['name']}@{c['n']}": check(c["path"], c["n"], c["dtype"], c["quantization"]) for c in cases}
        )
    )


if __name__ == "__main__":
    main()
