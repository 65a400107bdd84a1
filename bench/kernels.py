"""Benchmark the multi-LoRA ops on CPU against a dense merged-weight matmul.

Run ``python bench/kernels.py`` (or ``make bench``). For one projection (in = out = 1024, S = 16
slots of rank R = 16, f32) it times, per token count T:

* ``dense``     — ``x @ W``: the merged-weight / no-LoRA peer;
* ``xla``       — ``x @ W`` then ``add_lora(..., backend="xla-onehot")`` (one-hot over every slot: the
  ``xla-onehot`` backend object's decode op);
* ``grouped``   — decode only: ``x @ W`` then ``kernels.grouped`` (rows grouped by slot on the host,
  weights-first pools: the ``xla-grouped`` backend object's decode op, ``--kernel-backend xla``);
* ``reference`` — ``x @ W`` then ``add_lora(..., backend="reference")`` (per-token gather);
* ``cpu``, ``cpu_bf16`` — ``x @ W`` then ``add_lora(..., backend="cpu")`` with f32 / bf16 pools (the C++
  kernels, the worker's default on CPUs; left out where they do not build);
* ``sgmv``      — prefill only: ``x @ W`` then ``add_lora_sgmv`` (masked over G segments).

Decode batches (T = 16, 32, 64) give every token its own adapter (``idx = t mod S``); prefill
batches (T = 512, 1024, 2048) are G = 4 prompts of T/4 tokens, each with one adapter. Every number
is the median wall time of 15 (prefill) or 100 (decode) ``block_until_ready`` runs of an already
compiled function, the variants timed round-robin.
The last line printed is one JSON object with all the numbers and ratios
(``dense_over_x`` = dense time ÷ x time: the fraction of merged-weight throughput x keeps).

``--shape 8b`` times an 8B model's largest projection (in 4096, out 14336, ``bench/device.sh`` on an
accelerator), ``--shape tiny`` a 128² one with fewer runs (the smoke test), ``--dtype bfloat16`` every
operand in bf16 (the cpu kernels, which take f32 activations, are then left out).

``--quant`` times the base-weight kernels of a decode step instead (``kernels.cpu``, needs the C++ kernels):
for one projection (N = K = 4096; ``--shape 8b`` N = 14336, K = 4096; ``--shape tiny`` 128²) and M = 1, 16
bf16 rows it times ``linear_bf16`` (bf16 w), ``linear_int8`` (int8 w, a scale per row) and ``linear_int4``
(packed int4 w, a scale per 128 inputs) under ``jax.jit``: median ms, the weights' bytes (scales included)
per second, and ``speedup_int8`` / ``speedup_int4`` = bf16 ms ÷ quantized ms. Its last line is one JSON
object too (``"bench": "kernels_quant"``); ``LORASERVE_KERNEL_MARCH`` picks the build (e.g. ``x86-64-v3``),
``LORASERVE_KERNEL_AMX_INT8=0`` turns off int8's fixed-point path on AMX-INT8 CPUs (to measure what it replaces).

``--scan`` times the decode ops as a decode step reads them instead, every backend inside one compiled program
per shape over L distinct layers' weights (the numbers that mean something on an accelerator):

Timing one call at a time says little on an accelerator: on a TPU each call costs ~0.5 ms of dispatch, where
a 4096 × 4096 bf16 product's bytes take 0.04 ms; and one weight reused in a loop can stay in on-chip memory. So
per backend and batch the program runs L distinct layers, unrolled over separate per-layer arrays as the
engine's decoder is (``--stacked``: a ``lax.scan`` over stacked layers, whose slicing of each layer's arrays
XLA fuses into its own products but copies for a Pallas kernel: on the chip the copies of the slot pools cost
the Pallas rows more than their kernels, 2026-12-08): layer l computes
``y = x @ W[l]`` plus the backend's ``add_decode`` with layer l's slot pools ``A[l], B[l]`` (``S`` slots of rank
``R``, every row its own adapter: ``S = batch``), and feeds ``y`` to the next layer (so no layer's work can be
skipped or hoisted). ``dense`` is the same program without LoRA: the base model's peer.

Per row (backend, batch): the largest difference of its last layer's output from the reference backend's
(``max_abs_diff``: a timed path that computes something else is no peer), ``ms`` per layer (median of the shape's runs of the whole scan ÷ L), ``gbps`` (the
layer's weight bytes plus the batch's adapters' A and B bytes ÷ that time), ``over_dense`` (dense ms ÷ this
ms: the fraction of the base step's speed the adapters leave) and ``serial_bound`` (what the adapters would
cost read after the base product at the bandwidth dense measured: dense ms ÷ (dense ms + adapter bytes ÷
dense's GB/s); a backend that overlaps the reads beats it). Backends: reference, xla-onehot, xla-grouped,
pallas (its decode kernel, ``kernels.pallas_decode``, slots in groups of 128 rank rows), pallas-vpu (the
vector-unit kernel of ``kernels.pallas_vpu``: multiply-adds per row, no MXU, on its own pools), pallas-d256 and
pallas-d512 (the same kernel with groups of 256 and 512 rank rows) and pallas-tiled (the tiled kernels of its
first version), all compiled on a TPU and interpreted elsewhere (so only at ``--shape tiny``), cpu where the C++
kernels build.
Its last line is one JSON object too (``"bench": "kernels_scan"``, with the run's XLA compilations and seconds);
``--shape`` picks one of ``SCAN_SHAPES``, ``--batch 16,64`` other batches than the shape's. ``--profile DIR``
traces three more calls of every row, each inside a trace annotation ``scan <backend> B<batch>``, a
``jax.profiler`` trace per row with a Perfetto JSON (``DIR/scan-<backend>-B<batch>/plugins/profile/<run>/
perfetto_trace.json.gz``);
``bench/trace_summary.py DIR`` turns them into each row's device time by op and the device's idle time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import time

import _compiles  # in bench/, first on sys.path
import _source_tree

# loraserve from this repository, installed or not; bench/, where this file would shadow the `kernels`
# package, off sys.path
_source_tree.use()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from loraserve import kernels  # noqa: E402
from loraserve.kernels import grouped as grouped_kernels  # noqa: E402
from loraserve.kernels import pallas_vpu  # noqa: E402

D_IN = D_OUT = 1024
S, R, G = 16, 16, 4
DECODE_T = (16, 32, 64)
PREFILL_T = (512, 1024, 2048)
# --shape: (in, out, prefill token counts, decode runs, prefill runs)
SHAPES = {
    "bench": (D_IN, D_OUT, PREFILL_T, 100, 15),
    "8b": (4096, 14336, PREFILL_T, 100, 15),
    "tiny": (128, 128, (64, 128, 256), 10, 3),
}
# --quant: (N, K, runs) of the projection the base-weight kernels are timed on, per --shape
QUANT_SHAPES = {"bench": (4096, 4096, 50), "8b": (14336, 4096, 30), "tiny": (128, 128, 10)}
QUANT_ROWS = (1, 16)
QUANT_GROUP = 128


def median_ms(fns: dict, runs: int) -> dict[str, float]:
    """Median wall time in ms of each ``fns[name]()`` after a warm-up (compiling) call.

    The functions are timed round-robin, so a burst of load on this shared machine hits them all
    alike instead of skewing one of the ratios.
    """
    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


@jax.jit
def dense(x, W):  # [T, out]
    """*Semantics:* the merged-weight projection ``x @ W``."""
    return x @ W


@functools.cache
def _with_lora(backend: str):
    @jax.jit
    def run(x, W, A, B, idx):  # [T, out]
        return kernels.add_lora(x @ W, x, A, B, idx, backend=backend)

    return run


@jax.jit
def grouped(x, W, A_t, B_t, plan):  # [T, out]
    return grouped_kernels.add_lora_slices_grouped(x @ W, x, A_t, (B_t,), plan)


@jax.jit
def sgmv(x, W, A, B, seg_slots, seg_lens):  # [T, out]
    return kernels.add_lora_sgmv(x @ W, x, A, B, seg_slots, seg_lens)


def bench_shape(T: int, prefill: bool, weights, rng, runs: int = 0) -> dict:
    W, A, B = weights
    x = jnp.asarray(rng.standard_normal((T, W.shape[0])), W.dtype)
    runs = runs or (15 if prefill else 100)
    if prefill:
        seg_slots = jnp.asarray(rng.permutation(S)[:G], jnp.int32)
        seg_lens = jnp.full((G,), T // G, jnp.int32)
        idx = kernels.segments_to_idx(seg_slots, seg_lens, T)
    else:
        idx = jnp.arange(T, dtype=jnp.int32) % S
    fns = {
        "dense": lambda: dense(x, W),
        "xla": lambda: _with_lora("xla-onehot")(x, W, A, B, idx),
        "reference": lambda: _with_lora("reference")(x, W, A, B, idx),
    }
    if kernels.cpu.available() and x.dtype == jnp.float32:
        A16, B16 = A.astype(jnp.bfloat16), B.astype(jnp.bfloat16)
        fns["cpu"] = lambda: _with_lora("cpu")(x, W, A, B, idx)
        fns["cpu_bf16"] = lambda: _with_lora("cpu")(x, W, A16, B16, idx)
    if prefill:
        fns["sgmv"] = lambda: sgmv(x, W, A, B, seg_slots, seg_lens)
    else:
        A_t, B_t = jnp.swapaxes(A, 1, 2), jnp.swapaxes(B, 1, 2)
        plan = grouped_kernels.plan_groups(np.asarray(idx), S)
        fns["grouped"] = lambda: grouped(x, W, A_t, B_t, plan)
    row = {"T": T, "kind": "prefill" if prefill else "decode", "runs": runs}
    row.update({f"{name}_ms": ms for name, ms in median_ms(fns, runs).items()})
    for name in ("xla", "reference", "sgmv", "grouped", "cpu", "cpu_bf16"):
        if f"{name}_ms" in row:
            row[f"dense_over_{name}"] = round(row["dense_ms"] / row[f"{name}_ms"], 3)
    row["reference_over_xla"] = round(row["reference_ms"] / row["xla_ms"], 3)
    for k, v in row.items():
        if k.endswith("_ms"):
            row[k] = round(v, 4)
    return row


def bench_quant(shape: str) -> dict:
    """``--quant``: bf16, int8 and int4 weights through the few-row C++ kernels, bf16 x (module doc)."""
    cpu = kernels.cpu
    if not cpu.available():
        raise SystemExit("--quant needs the C++ kernels (kernels.cpu), which do not build or load here")
    t_start = time.perf_counter()
    N, K, runs = QUANT_SHAPES[shape]
    group = min(QUANT_GROUP, K)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((N, K)) / np.sqrt(K), jnp.bfloat16)
    q8 = jnp.asarray(rng.integers(-127, 128, (N, K)), jnp.int8)
    s8 = jnp.asarray(rng.uniform(0.5, 1.5, N) / (127 * np.sqrt(K)), jnp.float32)
    q4 = jnp.asarray(rng.integers(0, 256, (N, K // 2)), jnp.uint8)  # any byte is two valid nibbles
    s4 = jnp.asarray(rng.uniform(0.5, 1.5, (N, K // group)) / (7 * np.sqrt(K)), jnp.float32)
    weight_bytes = {"bf16": 2 * N * K, "int8": N * K + 4 * N, "int4": N * K // 2 + 4 * N * (K // group)}
    fns = {
        "bf16": jax.jit(cpu.linear_bf16),
        "int8": jax.jit(cpu.linear_int8),
        "int4": jax.jit(cpu.linear_int4),
    }
    args = {"bf16": (w,), "int8": (q8, s8), "int4": (q4, s4)}
    march = os.environ.get("LORASERVE_KERNEL_MARCH") or "native"
    print(
        f"kernels bench --quant: N={N} K={K} int4 group={group}, bf16 x, build -march={march} "
        f"(bf16 dot products: {cpu.bf16_dot()}, AMX tiles: {cpu.amx()}, int8 fixed-point rows: "
        f"{cpu.quant_fixed_rows(K)}), {os.cpu_count()} CPUs, "
        f"jax {jax.__version__}"
    )
    print("speedup = bf16 ms / quantized ms; GB/s = the weights' bytes (scales included) / time")
    rows = []
    for M in QUANT_ROWS:
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
        calls = {name: functools.partial(fn, x, *args[name]) for name, fn in fns.items()}
        ms = median_ms(calls, runs)
        row = {"M": M, "runs": runs}
        for name in fns:
            row[f"{name}_ms"] = round(ms[name], 4)
            row[f"{name}_gb_s"] = round(weight_bytes[name] / ms[name] / 1e6, 2)
        for name in ("int8", "int4"):
            row[f"speedup_{name}"] = round(ms["bf16"] / ms[name], 3)
        rows.append(row)
        print(
            f"M={M:3d}  "
            + "  ".join(f"{n} {row[f'{n}_ms']:8.3f} ms ({row[f'{n}_gb_s']:6.1f} GB/s)" for n in fns)
            + f"  speedup int8 {row['speedup_int8']:.2f}  int4 {row['speedup_int4']:.2f}"
        )
    return {
        "bench": "kernels_quant",
        "config": {
            "N": N,
            "K": K,
            "group": group,
            "x_dtype": "bfloat16",
            "march": march,
            "bf16_dot": cpu.bf16_dot(),
            "amx": cpu.amx(),
            "int8_fixed_rows": cpu.quant_fixed_rows(K),  # rows up to which int8 skips converting (AMX-INT8)
            "weight_bytes": weight_bytes,
        },
        "platform": {"backend": jax.default_backend(), "cpus": os.cpu_count(), "machine": platform.machine()},
        "rows": rows,
        "seconds": round(time.perf_counter() - t_start, 1),
    }


# --shape for --scan: (in, out, layers, batches, runs); the 8b shape is Llama-3-8B's up/gate projection
SCAN_SHAPES = {
    "bench": (1024, 1024, 8, (16, 64), 20),
    "8b": (4096, 14336, 8, (16, 64, 128), 20),
    "8b-attn": (4096, 4096, 16, (16, 64, 128), 20),
    "tiny": (128, 256, 2, (4, 8), 3),
}
RANK = 16


class _PallasTiled(kernels.XlaOneHotBackend):
    """The tiled Pallas kernels (``kernels.pallas``) on the canonical pools: the decode kernel's first
    predecessor, timed beside it (``pallas-tiled``)."""

    def add_decode(self, y, x, a, bs, plan):
        return kernels.pallas.add_lora_slices(y, x, a, tuple(bs), plan)


@dataclasses.dataclass(frozen=True)
class _PallasDepth(kernels.PallasBackend):
    """The pallas backend with groups of ``depth`` rank rows instead of ``MXU_DEPTH`` (``pallas-d256``...)."""

    depth: int = kernels.pallas_decode.MXU_DEPTH

    def add_decode(self, y, x, a, bs, plan):
        outs = [b.shape[2] for b in bs]
        dtypes = (x.dtype, a.dtype, bs[0].dtype, y.dtype)
        if not kernels.pallas_decode.fits(x.shape[0], a.shape[2], a.shape[1], outs, *dtypes, self.depth):
            raise ValueError(f"does not fit the decode kernel at depth {self.depth}")
        return kernels.pallas_decode.add_lora_slices_decode(y, x, a, tuple(bs), plan, depth=self.depth)


@dataclasses.dataclass(frozen=True)
class _PallasVpu(kernels.PallasBackend):
    """The VPU decode kernel (``kernels.pallas_vpu``: multiply-adds per row, no MXU) on its own pools:
    ``A [S, n*R, in/128, 128]``, ``B [S, R, out/128, 128]`` (the rank-major matrices reshaped)."""

    def to_pool_layout(self, value, kind):
        return pallas_vpu.to_pool(super().to_pool_layout(value, kind))

    def plan(self, slots, num_slots):
        return pallas_vpu.plan_vpu(slots, num_slots)

    def add_decode(self, y, x, a, bs, plan):
        outs = [b.shape[2] * pallas_vpu.LANES for b in bs]
        if not pallas_vpu.fits(x.shape[0], x.shape[1], bs[0].shape[1], outs, x.dtype, a.dtype, y.dtype):
            raise ValueError("does not fit the VPU kernel")
        return pallas_vpu.add_lora_slices_vpu(y, x, a, tuple(bs), plan)


def _backend(name: str) -> kernels.LoraBackend:
    if name == "pallas-vpu":
        return _PallasVpu()
    if name.startswith("pallas-d"):
        return _PallasDepth(depth=int(name.removeprefix("pallas-d")))
    return _PallasTiled() if name == "pallas-tiled" else kernels.get_backend(name)


def _backends(tiny: bool) -> list[str]:
    names = ["reference", "xla-onehot", "xla-grouped"]
    if jax.default_backend() == "tpu" or tiny:  # interpreted off a TPU: minutes at real sizes
        names += ["pallas", "pallas-vpu", "pallas-d256", "pallas-d512", "pallas-tiled"]
    if kernels.cpu.available():
        names.append("cpu")
    return names


def _program(backend: kernels.LoraBackend | None, stacked: bool = False):
    """The L-layer program: unrolled over per-layer arrays (``w``, ``a``, ``b`` tuples), as the engine's decoder
    is, or (``stacked``) a ``lax.scan`` over stacked ones, which slices each layer's arrays out of the stack:
    XLA fuses that slice into its own products but copies it for a Pallas kernel's operands."""

    def layer(x, weights, plan):
        w, a, b = weights
        y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
        if backend is not None:
            y = backend.add_decode(y, x, a, (b,), plan)
        return y

    @jax.jit
    def run(x, w, a, b, plan):  # [B, out] after L layers; out >= in: the next layer reads the first `in`
        if stacked:

            def body(carry, weights):
                return layer(carry, weights, plan)[:, : carry.shape[1]], None

            return jax.lax.scan(body, x, (w, a, b))[0]
        for weights in zip(w, a, b, strict=True):
            x = layer(x, weights, plan)[:, : x.shape[1]]
        return x

    return run


def _layers(stack, stacked: bool):
    """A stacked ``[L, ...]`` array as the program takes it: as it is, or a tuple of L separate arrays."""
    return stack if stacked else tuple(stack[i] for i in range(stack.shape[0]))


def _time(fn, args, runs: int) -> tuple[float, np.ndarray]:
    """Median ms of ``fn(*args)`` after a compiling call, and that call's output."""
    out = np.asarray(jax.block_until_ready(fn(*args)), np.float32)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def _profiled(profile: str | None, label: str, fn, args, runs: int = 3) -> None:
    """``--profile``: ``runs`` more calls of the compiled ``fn``, each inside a trace annotation ``label``, in a
    jax.profiler trace of their own under ``profile`` (host Python not traced: it would fill the trace's
    event buffer; a Perfetto JSON beside it, which bench/trace_summary.py reads)."""
    if profile is None:
        return
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 1
    where = os.path.join(profile, label.replace(" ", "-"))  # a folder per row: runs are named by the second
    jax.profiler.start_trace(where, create_perfetto_trace=True, profiler_options=options)
    try:
        for _ in range(runs):
            with jax.profiler.TraceAnnotation(label):
                jax.block_until_ready(fn(*args))
    finally:
        jax.profiler.stop_trace()


def bench_scan(
    shape: str,
    dtype_name: str,
    batches: tuple[int, ...] = (),
    profile: str | None = None,
    stacked: bool = False,
    only: tuple[str, ...] = (),
) -> dict:
    t_start = time.perf_counter()
    _compiles.start()
    d_in, d_out, layers, shape_batches, runs = SCAN_SHAPES[shape]
    batches = batches or shape_batches
    dtype = jnp.dtype(dtype_name)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((layers, d_in, d_out), np.float32) / np.sqrt(d_in), dtype)
    w = _layers(w, stacked)  # unrolled: separate buffers (the stack is dropped)
    w_small = _layers(jnp.zeros((layers, 1, 1), dtype), stacked)
    w_bytes = d_in * d_out * dtype.itemsize
    rows = []
    for batch in batches:
        slots = batch  # every row its own adapter
        a = rng.standard_normal((layers, slots, d_in, RANK), np.float32) / np.sqrt(d_in)
        b = rng.standard_normal((layers, slots, RANK, d_out), np.float32) / np.sqrt(RANK)
        x = jnp.asarray(rng.standard_normal((batch, d_in), np.float32), dtype)
        lora_bytes = slots * RANK * (d_in + d_out) * dtype.itemsize
        row_slots = np.arange(batch, dtype=np.int32) % slots
        dense_args = (x, w, w_small, w_small, None)
        dense_program = _program(None, stacked)
        dense_ms = _time(dense_program, dense_args, runs)[0] / layers
        _profiled(profile, f"scan dense B{batch}", dense_program, dense_args)
        dense_gbps = w_bytes / dense_ms / 1e6
        rows.append(dict(backend="dense", batch=batch, ms=round(dense_ms, 4), gbps=round(dense_gbps, 1)))
        print(json.dumps(rows[-1]), flush=True)  # as it comes: a run cut short keeps what it timed
        serial = dense_ms / (dense_ms + lora_bytes / dense_gbps / 1e6)
        want = None  # the reference backend's output: every other backend's is compared with it
        for name in [n for n in _backends(shape == "tiny") if not only or n in only]:
            backend = _backend(name)
            a_pool, b_pool = (
                _layers(
                    jnp.asarray(
                        jax.vmap(jax.vmap(functools.partial(backend.to_pool_layout, kind=kind)))(
                            jnp.asarray(m)
                        ),
                        dtype,
                    ),
                    stacked,
                )
                for m, kind in ((a, "A"), (b, "B"))
            )
            plan = backend.plan(row_slots, slots)
            row = dict(backend=name, batch=batch, adapters=slots)
            try:
                program, args = _program(backend, stacked), (x, w, a_pool, b_pool, plan)
                ms, out = _time(program, args, runs)
                ms /= layers
                _profiled(profile, f"scan {name} B{batch}", program, args)
                want = out if want is None else want
                row.update(
                    max_abs_diff=float(np.max(np.abs(out - want))),
                    ms=round(ms, 4),
                    gbps=round((w_bytes + lora_bytes) / ms / 1e6, 3),
                    over_dense=round(dense_ms / ms, 3),
                    serial_bound=round(serial, 3),
                )
            except Exception as exc:  # a backend that cannot run this shape here: say why
                row.update(error=(str(exc).strip().splitlines() or [type(exc).__name__])[0][:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {
        "bench": "kernels_scan",
        "config": {
            "in": d_in,
            "out": d_out,
            "layers": layers,
            "rank": RANK,
            "dtype": dtype_name,
            "layout": "stacked" if stacked else "unrolled",
        },
        "rows": rows,
        "compiles": _compiles.totals(),
        "seconds": round(time.perf_counter() - t_start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", choices=sorted({*SHAPES, *SCAN_SHAPES}), default="bench", help="the projection's size"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--quant",
        action="store_true",
        help="time the bf16 / int8 / int4 base-weight kernels instead (module doc)",
    )
    parser.add_argument(
        "--scan", action="store_true", help="every backend inside one compiled scan over layers (module doc)"
    )
    parser.add_argument(
        "--backends",
        help="--scan: only these backends (a comma list; dense always runs), e.g. pallas,xla-grouped",
    )
    parser.add_argument(
        "--stacked",
        action="store_true",
        help="--scan: a lax.scan over stacked layers instead of the engine's unrolled layers (module doc)",
    )
    parser.add_argument(
        "--batch",
        help="--scan: these batches (a comma list) instead of the shape's, each row its own adapter",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="--scan: also trace 3 more calls of every row (jax.profiler, a Perfetto trace under DIR; "
        "bench/trace_summary.py DIR sums the device's time per row and op)",
    )
    args = parser.parse_args()
    if args.shape not in (SCAN_SHAPES if args.scan else SHAPES):
        parser.error(f"--shape {args.shape} is not a shape of {'--scan' if args.scan else 'this mode'}")
    if (args.batch or args.profile or args.backends or args.stacked) and not args.scan:
        parser.error("--batch, --backends, --profile and --stacked are for --scan")
    if args.scan:
        batches = tuple(int(b) for b in args.batch.split(",")) if args.batch else ()
        only = tuple(args.backends.split(",")) if args.backends else ()
        result = bench_scan(args.shape, args.dtype, batches, args.profile, args.stacked, only)
        result["platform"] = {
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
        }
        print(json.dumps(result, separators=(",", ":")))
        return
    if args.quant:
        print(json.dumps(bench_quant(args.shape), separators=(",", ":")))
        return
    d_in, d_out, prefill_t, decode_runs, prefill_runs = SHAPES[args.shape]
    dtype = jnp.dtype(args.dtype)
    t_start = time.perf_counter()
    rng = np.random.default_rng(0)
    W = jnp.asarray(rng.standard_normal((d_in, d_out)) / np.sqrt(d_in), dtype)
    A = jnp.asarray(rng.standard_normal((S, d_in, R)) / np.sqrt(d_in), dtype)
    B = jnp.asarray(rng.standard_normal((S, R, d_out)) / np.sqrt(R), dtype)
    short = {"float32": "f32", "bfloat16": "bf16"}[args.dtype]
    print(
        f"kernels bench: in={d_in} out={d_out} S={S} R={R} {short}, backend={jax.default_backend()}, "
        f"{os.cpu_count()} CPUs, jax {jax.__version__}"
    )
    print("lora cost = x@W + add_lora; ratio = dense time / that time (1.0 = as fast as merged weights)")
    rows = []
    for prefill, Ts in ((False, DECODE_T), (True, prefill_t)):
        for T in Ts:
            row = bench_shape(T, prefill, (W, A, B), rng, prefill_runs if prefill else decode_runs)
            rows.append(row)
            if prefill:
                extra = f"  sgmv {row['sgmv_ms']:8.3f} ms ({row['dense_over_sgmv']:.2f})"
            else:
                extra = f"  grouped {row['grouped_ms']:8.3f} ms ({row['dense_over_grouped']:.2f})"
            if "cpu_ms" in row:
                extra += f"  cpu {row['cpu_ms']:8.3f} ms  cpu_bf16 {row['cpu_bf16_ms']:8.3f} ms"
            print(
                f"{row['kind']:7s} T={T:5d}  dense {row['dense_ms']:8.3f} ms  "
                f"xla {row['xla_ms']:8.3f} ms ({row['dense_over_xla']:.2f})  "
                f"reference {row['reference_ms']:8.3f} ms ({row['dense_over_reference']:.2f}){extra}"
            )
    summary = {
        "bench": "kernels",
        "config": {"in": d_in, "out": d_out, "S": S, "R": R, "G_prefill": G, "dtype": args.dtype},
        "platform": {"backend": jax.default_backend(), "cpus": os.cpu_count(), "machine": platform.machine()},
        "rows": rows,
        "geomean_dense_over_xla_decode": _geomean(r["dense_over_xla"] for r in rows if r["kind"] == "decode"),
        "geomean_dense_over_grouped_decode": _geomean(
            r["dense_over_grouped"] for r in rows if r["kind"] == "decode"
        ),
        **(
            {
                f"geomean_dense_over_{name}_{kind}": _geomean(
                    r[f"dense_over_{name}"] for r in rows if r["kind"] == kind
                )
                for name in ("cpu", "cpu_bf16")
                for kind in ("decode", "prefill")
            }
            if "cpu_ms" in rows[0]
            else {}
        ),
        "geomean_dense_over_sgmv_prefill": _geomean(
            r["dense_over_sgmv"] for r in rows if r["kind"] == "prefill"
        ),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(summary, separators=(",", ":")))


def _geomean(values) -> float:
    vals = list(values)
    return round(float(np.exp(np.mean(np.log(vals)))), 3)


if __name__ == "__main__":
    main()
