"""Decode attention over the paged KV cache: an XLA gather path (every platform) and JAX's TPU kernel.

The cache layout is the one JAX's TPU paged-attention kernel reads (docs/design.md §10.3): per layer
``k_pages, v_pages [kv_heads, num_pages, page_size, head_dim]``, page 0 the null page, each row's page
table ``[B, W]`` listing its first W pages. Three implementations of one semantics:

* ``xla``: gather every row's W pages (``k_pages[:, page_tables]``), dense GQA attention over the
  ``W * page_size`` positions, masked by position. What decode ran before this module existed,
  moved here op for op (the compiled CPU program is the same).
* ``cpu``: ``kernels.cpu.paged_attention``, a C++ FFI kernel that reads each row's pages in place (the
  xla path copies them: 128 MB a step at batch 64 of the bench model); the xla impl's arithmetic, bf16
  probabilities included (bf16 results equal bit for bit in the tests, f32 within 1e-6).
* ``pallas``: ``jax.experimental.pallas.ops.tpu.paged_attention`` — per (row, KV head) it DMAs only
  the pages below the row's length, ``pages_per_compute_block`` at a time, double-buffered, with an
  online softmax. It does not scale q (we pass ``q * scale``, in f32), masks keys at index
  ``>= lengths[b]`` (we pass ``positions + 1``), soft-caps ``q . k`` like Gemma 2, and has no sliding
  window: a layer with one falls back to ``xla`` (static per layer). Inside, it rounds K and V to
  bfloat16 (its dequantization helper casts to bf16 even without scales), so a float32 cache attends at
  bf16 K/V precision. Off a TPU it runs in Pallas' TPU interpret mode (slow; for tests).

Under tensor parallelism (a 1-D ``model`` mesh splitting heads and the cache by KV head,
``models.sharding``) a ``pallas_call`` cannot be auto-partitioned: the kernel runs per device inside
``jax.shard_map`` (q split by heads, pages by KV head, positions and page tables replicated). Each
device's q heads read its own KV heads, so no communication is needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from loraserve.kernels import cpu as cpu_kernels
from loraserve.kernels import pallas as pallas_kernels
from loraserve.kernels.sharded import AXIS

Array = jax.Array
IMPLS = ("xla", "pallas", "cpu")
ATTENTION_BACKENDS = ("auto", *IMPLS)  # what --attention-backend accepts
# pages per compute block of the TPU kernel: the largest that divides the page-table width and keeps a
# block within MAX_BLOCK_TOKENS (k and v, double-buffered: 4 x 512 x head_dim 256 x 4 B = 2 MiB of VMEM)
BLOCK_CANDIDATES = (16, 8, 4, 2, 1)
MAX_BLOCK_TOKENS = 512


def resolve_attention(name: str, head_dim: int | None = None, page_size: int | None = None) -> str:
    """``--attention-backend`` value -> implementation. ``auto``: on a TPU, ``pallas`` where JAX's kernel
    was measured faster than the xla impl for the model's ``head_dim`` and ``page_size``
    (:func:`tpu_kernel_faster`), else ``xla``; on a CPU, ``cpu`` where the C++ kernels build
    (``kernels.cpu.available``), else ``xla``."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "auto":
        if jax.default_backend() == "tpu":
            fast = head_dim is not None and page_size is not None and tpu_kernel_faster(head_dim, page_size)
            return "pallas" if fast else "xla"
        return "cpu" if cpu_kernels.available() else "xla"
    return name


def tpu_kernel_faster(head_dim: int, page_size: int) -> bool:
    """Whether JAX's TPU kernel attends faster than the xla impl, as ``bench/attention.py`` measured on a TPU
    v5e (docs/kernels.md; bf16, 32 rows of ~1k tokens, 32 query / 8 KV heads): for head size 256 at pages of
    16 it took 1.53 ms a layer where xla took 2.97; for head size 128 xla was ahead at every page size (0.80
    vs 1.02 ms at 16, 0.87 vs 2.45 at 4, 0.73 vs 0.78 at 64); below 128 the kernel does not compile."""
    return head_dim % 128 == 0 and head_dim >= 256 and page_size >= 16


def pages_per_compute_block(width: int, page_size: int) -> int:
    """The TPU kernel's block: the largest of ``BLOCK_CANDIDATES`` that divides ``width`` (it must) and
    spans at most ``MAX_BLOCK_TOKENS`` positions (one page when a page alone is larger)."""
    fits = [c for c in BLOCK_CANDIDATES if width % c == 0 and (c == 1 or c * page_size <= MAX_BLOCK_TOKENS)]
    return fits[0]


def pallas_takes(
    head_dim: int, window: int | None = None, interpret: bool = False, dtype: Any = None
) -> bool:
    """Whether the TPU kernel (``impl="pallas"``) runs a layer of this shape; where it does not, that layer
    attends through the ``xla`` impl (decided at trace time, per layer).

    JAX's kernel has no sliding window, and its block specs tile the head dimension in whole 128-lane vregs:
    for a head size that is not a multiple of 128 (16, 64, 80, 96) Mosaic refuses the kernel ("last two
    dimensions of your block shape are divisible by 8 and 128"), measured on a TPU v5e (docs/kernels.md).
    Compiled for the chip it also takes 16-bit q only (``dtype``, None: not checked): it rounds K and V to
    bfloat16 whatever the cache holds, so a float32 model (computed at ``highest`` precision,
    ``EngineConfig.matmul_precision``) would attend at bf16 — and Mosaic refused its f32 x bf16 product at
    that precision on the v5e ("Bad rhs type"). Interpreted (off a TPU, ``interpret``) the kernel takes
    every head size and dtype: the tests run it on tiny f32 heads."""
    if window is not None:
        return False
    if interpret:
        return True
    return head_dim % 128 == 0 and (dtype is None or jnp.dtype(dtype).itemsize == 2)


def _softcap(x: Array, cap: float | None) -> Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


def _xla(q, k_pages, v_pages, positions, page_tables, *, scale, softcap, window):  # [B, heads, D]
    b, w = page_tables.shape
    kv, _, page, d = k_pages.shape
    heads = q.shape[1]
    key_pos = jnp.arange(w * page)
    mask = key_pos[None, :] <= positions[:, None]  # [B, W*P]
    if window is not None:  # only the last `window` positions
        mask = mask & (key_pos[None, :] > positions[:, None] - window)
    kv_shape = (kv, b, w * page, d)
    k_rows = k_pages[:, page_tables].reshape(kv_shape)  # [kv, B, S, D]
    v_rows = v_pages[:, page_tables].reshape(kv_shape)
    qg = q.reshape(b, kv, heads // kv, d)
    # keys first: the gathered keys are the dot's left side as they lie ([S, D] per (kv, row)), where
    # "bkgd,kbsd->bkgs" had XLA:CPU transpose every gathered key to [D, S] first (bf16 decode attention
    # 1.02 -> 0.57 ms for 8 layers of the bench model at batch 16); the scores' transpose is small
    scores = jnp.einsum("kbsd,bkgd->kbsg", k_rows, qg, preferred_element_type=jnp.float32)
    scores = scores.transpose(1, 0, 3, 2)  # [B, kv, group, S]
    scores = _softcap(scores * scale, softcap)
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_rows.dtype)
    return jnp.einsum("bkgs,kbsd->bkgd", probs, v_rows).reshape(b, heads, d)


def _pallas(q, k_pages, v_pages, positions, page_tables, *, scale, softcap, interpret):  # [B, heads, D]
    block = pages_per_compute_block(page_tables.shape[1], k_pages.shape[2])
    run = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    # the kernel's own arithmetic (f32 q against bf16 K/V, one MXU pass), whatever precision the caller's
    # context asks of its matmuls: Mosaic refuses its product at `highest`
    with run, jax.default_matmul_precision("default"):  # decides at trace time how the pallas_call lowers
        out = paged_attention(
            q.astype(jnp.float32) * scale,
            k_pages,
            v_pages,
            (positions + 1).astype(jnp.int32),
            page_tables.astype(jnp.int32),
            attn_logits_soft_cap=softcap,
            pages_per_compute_block=block,
        )
    return out.astype(q.dtype)


def decode_attention(
    q: Array,  # [B, heads, D], RoPE applied, not scaled
    k_pages: Array,  # [kv_heads, N, P, D]
    v_pages: Array,  # [kv_heads, N, P, D]
    positions: Array,  # [B] int32: the query's position (its key/value already written there)
    page_tables: Array,  # [B, W] int32: each row's first W pages, W * P > every position
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
    impl: str,
    mesh: Mesh | None = None,
    interpret: bool | None = None,
) -> Array:
    """One query per row over its paged keys/values -> ``[B, heads, D]`` in q's dtype.

    *Semantics:* head h of row b attends (GQA: KV head ``h // (heads / kv_heads)``) to positions
    ``0..positions[b]`` of its pages (only those ``> positions[b] - window`` when ``window`` is set),
    logits ``softcap(scale * q . k)``, softmax in f32. ``impl`` ``"xla"``, ``"pallas"`` (the JAX TPU
    kernel; ``window`` layers use ``"xla"``) or ``"cpu"`` (``kernels.cpu.paged_attention``: pages read in
    place, the xla impl's arithmetic); ``mesh``: the tensor-parallel mesh the arrays are split
    over (axis ``model``: q by heads, pages by KV head), needed by ``"pallas"`` and ``"cpu"``; ``interpret``: run the
    kernel interpreted (None = off a TPU).
    """
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    interp = pallas_kernels.default_interpret() if interpret is None else interpret
    if impl == "xla" or (impl == "pallas" and not pallas_takes(q.shape[-1], window, interp, q.dtype)):
        return _xla(q, k_pages, v_pages, positions, page_tables, scale=scale, softcap=softcap, window=window)
    if impl == "cpu":
        fn = lambda q, k, v, pos, tables: cpu_kernels.paged_attention(  # noqa: E731
            q, k, v, pos, tables, scale=scale, softcap=softcap, window=window
        )
    else:
        fn = lambda q, k, v, pos, tables: _pallas(  # noqa: E731
            q, k, v, pos, tables, scale=scale, softcap=softcap, interpret=interp
        )
    if mesh is None:
        return fn(q, k_pages, v_pages, positions, page_tables)
    heads, pages = P(None, AXIS, None), P(AXIS, None, None, None)
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(heads, pages, pages, P(), P()), out_specs=heads, check_vma=False
    )(q, k_pages, v_pages, positions, page_tables)


@dataclass(frozen=True)
class DecodeAttention:
    """What ``models.decoder.decode`` calls per layer: ``decode_attention`` with a fixed impl and mesh.

    Hashable (a frozen dataclass of a string, a ``Mesh`` and a flag), so it can ride in a jitted step's
    static arguments; one compilation per object.
    """

    impl: str = "xla"
    mesh: Mesh | None = None
    interpret: bool | None = None

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"attention impl must be one of {', '.join(IMPLS)}, got {self.impl!r}")

    @property
    def reads_bits(self) -> bool:
        """True when the impl takes bf16 pages as their uint16 bits as they are stored on a CPU
        (``models.decoder.kv_storage_dtype``): the caller then passes them without a bitcast, which XLA would
        materialise as a copy of the whole cache for the C++ kernel."""
        return self.impl == "cpu"

    @classmethod
    def of(cls, attention: str | DecodeAttention, backend: Any = None) -> DecodeAttention:
        """``attention`` (an impl name or an object) with the mesh of a sharded LoRA ``backend``
        (``kernels.sharded.ShardedBackend``) filled in where it has none."""
        obj = cls(attention) if isinstance(attention, str) else attention
        mesh = getattr(backend, "mesh", None)
        if obj.mesh is None and mesh is not None:
            obj = dataclasses.replace(obj, mesh=mesh)
        return obj

    def __call__(
        self, q, k_pages, v_pages, positions, page_tables, *, scale, softcap, window
    ):  # [B, heads, D]
        return decode_attention(
            q, k_pages, v_pages, positions, page_tables, scale=scale, softcap=softcap, window=window,
            impl=self.impl, mesh=self.mesh, interpret=self.interpret,
        )  # fmt: skip


__all__ = [
    "ATTENTION_BACKENDS",
    "DecodeAttention",
    "decode_attention",
    "pages_per_compute_block",
    "pallas_takes",
    "resolve_attention",
    "tpu_kernel_faster",
]
