"""Decode attention over the paged KV cache: every impl, per head size and page size, on this machine.

Run ``python bench/attention.py`` (on a TPU: the choice behind ``--attention-backend auto``, docs/kernels.md).
For each head size D (default 64, 80, 96, 128, 256) and page size P (default 4, 8, 16, 32, 64) it builds L
layers of a paged cache (``kernels.attention``'s layout: ``[kv_heads, pages, P, D]`` per layer, 8 KV heads,
32 query heads, B rows of ``--context`` tokens each in pages scattered over the pool) and times, per impl,
one compiled program that attends every layer in turn (a ``lax.scan`` over the stacked layers: each
iteration reads another layer's pages, as a decode step does; one dispatch for all of them, which a TPU
needs: a call alone costs ~0.5 ms of dispatch there). Per impl and shape it records:

* ``ok`` and, where the impl refuses the shape (the TPU kernel's block rules), the first line of its error;
* ``ms``: the median time of one layer's attention over ``--runs`` runs;
* ``gbps``: the K/V bytes the rows' pages hold ÷ that time (an impl that reads only live pages cannot beat
  the HBM bandwidth; the xla impl gathers the pages first, so it moves them twice);
* ``max_abs_diff`` against the xla impl (f32 probabilities; the TPU kernel rounds K/V to bf16 inside).

Impls: ``xla`` (gather + dense attention), ``pallas`` (what ``decode_attention`` runs for ``pallas``: the TPU
kernel where it takes the shape, ``xla`` where it does not), ``pallas-kernel`` (JAX's TPU kernel called
directly, to see which shapes it takes), and ``cpu`` where the C++ kernels build (off a TPU).
The last line printed is one JSON object with every row.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import _source_tree  # in bench/, first on sys.path

_source_tree.use()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from loraserve.kernels import attention as attn  # noqa: E402
from loraserve.kernels import cpu as cpu_kernels  # noqa: E402


def _cache(rng, layers, kv, pages, page, d, dtype):
    shape = (layers, kv, pages, page, d)
    return (
        jnp.asarray(rng.standard_normal(shape, np.float32), dtype),
        jnp.asarray(rng.standard_normal(shape, np.float32), dtype),
    )


def _program(impl: str, scale: float):
    def one(q, k_pages, v_pages, positions, tables):
        if impl == "pallas-kernel":
            return attn._pallas(
                q, k_pages, v_pages, positions, tables, scale=scale, softcap=None, interpret=False
            )
        return attn.decode_attention(
            q, k_pages, v_pages, positions, tables, scale=scale, softcap=None, window=None, impl=impl
        )

    @jax.jit
    def run(q, k_layers, v_layers, positions, tables):  # [L, B, heads, D]
        def body(carry, kv):
            k_pages, v_pages = kv
            out = one(q + carry, k_pages, v_pages, positions, tables)
            return carry + 0 * out[..., :1].astype(q.dtype).sum(), out  # chain the layers, as a step does

        return jax.lax.scan(body, jnp.zeros((), q.dtype), (k_layers, v_layers))[1]

    return run


def bench_shape(d: int, page: int, args, rng) -> list[dict]:
    dtype = jnp.dtype(args.dtype)
    b, kv, heads, layers = args.batch, args.kv_heads, args.heads, args.layers
    width = -(-args.context // page)  # pages per row
    width = -(-width // 16) * 16 if width > 16 else width  # a multiple the kernel's blocks divide
    pages = b * width + 1  # page 0: the null page
    k_layers, v_layers = _cache(rng, layers, kv, pages, page, d, dtype)
    perm = rng.permutation(np.arange(1, pages))[: b * width].reshape(b, width)
    tables = jnp.asarray(perm, jnp.int32)
    positions = jnp.asarray(rng.integers(args.context // 2, args.context, b), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, heads, d), np.float32), dtype)
    live_bytes = float(2 * kv * int(np.sum(np.asarray(positions) + 1)) * d * dtype.itemsize)
    scale = d**-0.5
    impls = ["xla", "pallas", "pallas-kernel"] if jax.default_backend() == "tpu" else ["xla"]
    if jax.default_backend() != "tpu" and cpu_kernels.available():
        impls.append("cpu")
    rows, outs = [], {}
    for impl in impls:
        row = {"impl": impl, "head_dim": d, "page_size": page, "dtype": args.dtype}
        try:
            fn = _program(impl, scale)
            out = fn(q, k_layers, v_layers, positions, tables)
            out.block_until_ready()
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                fn(q, k_layers, v_layers, positions, tables).block_until_ready()
                times.append((time.perf_counter() - t0) * 1e3 / layers)
            ms = statistics.median(times)
            outs[impl] = np.asarray(out.astype(jnp.float32))
            row.update(ok=True, ms=round(ms, 4), gbps=round(live_bytes / ms / 1e6, 1))
        except Exception as exc:  # a shape the kernel refuses: record why
            row.update(ok=False, error=(str(exc).strip().splitlines() or [type(exc).__name__])[0][:300])
        rows.append(row)
    for row in rows:
        if row["ok"] and "xla" in outs:
            row["max_abs_diff"] = float(np.max(np.abs(outs[row["impl"]] - outs["xla"])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,80,96,128,256")
    parser.add_argument("--page-sizes", default="4,8,16,32,64")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument(
        "--context", type=int, default=1024, help="tokens per row (positions in its upper half)"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a small shape, few runs (the smoke test)")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.heads, args.kv_heads, args.context, args.layers, args.runs = 2, 4, 2, 64, 2, 2
    rng = np.random.default_rng(0)
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for page in (int(x) for x in args.page_sizes.split(",")):
            for row in bench_shape(d, page, args, rng):
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {
        "bench": "attention",
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "machine": platform.machine(),
        "batch": args.batch,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "context": args.context,
        "layers": args.layers,
        "rows": rows,
    }
    print(json.dumps(summary, separators=(",", ":")))


if __name__ == "__main__":
    main()
