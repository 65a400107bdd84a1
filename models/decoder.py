"""The Llama-family decoder in JAX: prefill one sequence into paged KV, decode one token for every row.

The family differences are static ``ModelConfig`` fields (``models.config``): Gemma's ``1 + w``
RMSNorm and sandwich norms, q/k norm (Qwen3, Gemma 3), scaled embeddings, GELU-tanh, attention and final
logit soft-capping, sliding-window layers and a second RoPE table for them; layers are unrolled, so a
layer's kind costs no extra compiled variant.

Both steps take the device-step contract of ``models.step``: a ``DeviceState`` (params, LoRA pools, KV
cache, RoPE table) and a ``PrefillBatch`` or ``DecodeBatch``. Parameters come from ``models.checkpoint`` (one
dict per layer, matrices ``[out, in]`` as in Hugging Face, q/k/v and gate/up fused); the LoRA slot pools
(``LoraPools``) from ``models.lora.pools``: per layer one ``A_<group>`` with the ranks of the group's modules
side by side and one ``B_<module>`` per module, scaling folded into B (the layout and the ops belong to a
LoRA backend object, ``kernels.backends``, which the model calls without knowing which one it is), plus
per group the DoRA-scale and LoRA-bias vectors of ``models.lora.dora_bias``, applied to each adapter row's output
after the backend's LoRA, the same for every backend; and apart (``LoraPools.vocab``) the embed_tokens /
lm_head pools of ``models.lora.embedding``, added to each row's embedding and logits. The KV cache
is paged (docs/design.md §10.3): one ``(k_pages, v_pages)`` pair per layer, each ``[kv_heads, pages,
page_size, head_dim]`` (see ``init_cache``), updated in place (donated). A sequence's positions live in the pages its page table lists (``engine.kv_pages`` hands them
out); attention gathers a row's pages and masks by position, so the shapes never depend on which pages.

Layers are unrolled over separate per-layer arrays rather than scanned over stacked ones: on XLA:CPU a
``lax.scan`` slices each layer's weights out of the stack with a copy (the measurement: docs/performance.md,
*Why the worker's model looks the way it does*); unrolled code is what vLLM's TPU backend compiles as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.kernels.attention import DecodeAttention
from loraserve.kernels.backends import COLUMN, ROW, LoraBackend
from loraserve.kernels.linear import linear
from loraserve.models.config import LORA_GROUPS, ModelConfig
from loraserve.models.layers import activation, apply_rope, layer_inv_freq, matmul, norm, softcap, split_fused
from loraserve.models.lora.dora_bias import apply_vectors
from loraserve.models.lora.embedding import apply_embed, apply_lm_head
from loraserve.models.lora.layout import b_name
from loraserve.models.moe import moe_mlp
from loraserve.models.quantization import Quantized, qlinear
from loraserve.models.sampling import TOP_LOGPROBS, PromptScores, token_logprobs
from loraserve.models.step import Cache, DecodeBatch, DeviceState, Params, PrefillBatch

Array = jax.Array
Lora = list[dict[str, Array]]  # per layer: A_qkv, B_q, ... (LoraPools.layers)
# (y, x, layer pools, group, parallel, base bias) -> y + LoRA(x), then DoRA's scale and the LoRA bias of
# each row's slot (models.lora.dora_bias): the strategy differs between decode (per-row slots) and prefill (per
# segment); ``parallel`` (kernels.backends.COLUMN / ROW) says how tensor parallelism splits the layer.
LoraFn = Callable[[Array, Array, dict[str, Array], str, str, Array | None], Array]


def _embed(
    cfg: ModelConfig,
    params: Params,
    tokens: Array,
    vocab: dict[str, Array] | None = None,
    slots: Array | None = None,
) -> Array:
    """tokens [T] -> [T, H]; with the ``vocab`` pools (``LoraPools.vocab``) and ``slots`` ([G], T = G groups
    of consecutive tokens) each row's embed_tokens LoRA is added (``models.lora.embedding``); then Gemma scales
    by sqrt(hidden), rounded to the embedding dtype as HF does."""
    h = params["embed"][tokens]
    if vocab is not None and slots is not None and "A_embed" in vocab:
        h = apply_embed(h, tokens, vocab, slots)
    return h if cfg.embed_scale is None else h * jnp.asarray(cfg.embed_scale, h.dtype)


def _group_pools(ll: dict[str, Array], group: str) -> tuple[Array, tuple[Array, ...]]:
    """A layer's pools of one LoRA group: its ``A_<group>`` and the B pools of its modules."""
    return ll[f"A_{group}"], tuple(ll[b_name(m)] for m in LORA_GROUPS[group])


def _layer_mlp(
    cfg: ModelConfig,
    lp: dict[str, Array],
    ll: Lora,
    h: Array,
    lora_fn: LoraFn,
    shards: int = 1,
    slots: Array | None = None,
    mesh: Any = None,
) -> Array:
    """The MLP block; ``slots`` (each token's adapter slot, or None: no adapter anywhere) reaches a mixture
    of experts, whose LoRA on experts and router is computed beside them (``models.moe``; split over
    ``mesh``'s devices by expert when it has several)."""
    x = norm(cfg, h, lp["mlp_norm"])
    if cfg.is_moe:  # experts (and a shared expert) instead of one MLP; dense LoRA adapts attention only
        return h + moe_mlp(cfg, lp, x, ll=ll, slots=slots, mesh=mesh)
    gu = matmul(x, lp["w_gate_up"], lp.get("b_gate_up"))
    gu = lora_fn(gu, x, ll, "gate_up", COLUMN, lp.get("b_gate_up"))
    gate, up = split_fused(gu, (cfg.intermediate_size,) * 2, shards)
    act = activation(cfg, gate).astype(h.dtype) * up
    down = matmul(act, lp["w_down"], lp.get("b_down"))
    down = lora_fn(down, act, ll, "down", ROW, lp.get("b_down"))
    if cfg.sandwich_norms:
        down = norm(cfg, down, lp["post_mlp_norm"])
    return h + down


def _qkv(
    cfg: ModelConfig, lp: dict[str, Array], ll: Lora, h: Array, lora_fn: LoraFn, shards: int = 1
) -> tuple[Array, ...]:
    x = norm(cfg, h, lp["attn_norm"])
    qkv = matmul(x, lp["wqkv"], lp.get("bqkv"))
    qkv = lora_fn(qkv, x, ll, "qkv", COLUMN, lp.get("bqkv"))
    q, k, v = split_fused(qkv, (cfg.q_size, cfg.kv_size, cfg.kv_size), shards)
    lead = h.shape[:-1]
    q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:  # per head, before RoPE (Qwen3, Gemma 3)
        q, k = norm(cfg, q, lp["q_norm"]), norm(cfg, k, lp["k_norm"])
    return q, k, v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)


def _out_proj(
    lp: dict[str, Array], ll: Lora, h: Array, attn: Array, lora_fn: LoraFn, cfg: ModelConfig
) -> Array:
    o = matmul(attn, lp["wo"], lp.get("bo"))
    o = lora_fn(o, attn, ll, "o", ROW, lp.get("bo"))
    if cfg.sandwich_norms:  # Gemma: norm the attention output before the residual
        o = norm(cfg, o, lp["post_attn_norm"])
    return h + o


def _scores(cfg: ModelConfig, scores: Array) -> Array:
    """Raw f32 ``q . k`` -> scaled (and, for Gemma 2, soft-capped) attention logits, before the mask."""
    return softcap(scores * cfg.attn_scale, cfg.attn_logit_softcap)


def logits_from_hidden(
    cfg: ModelConfig,
    params: Params,
    h: Array,
    vocab: dict[str, Array] | None = None,
    slots: Array | None = None,
) -> Array:
    """h [G, H] -> logits [G, V] in f32. Semantics: final norm, lm_head (or tied embeddings), plus each
    row's lm_head LoRA (``vocab`` pools, ``slots`` [G], ``models.lora.embedding``) where given, then the final
    soft-cap where the config has one (Gemma 2)."""
    x = norm(cfg, h, params["final_norm"])
    head = params["lm_head"] if "lm_head" in params else params["embed"]
    logits = qlinear(x, head) if isinstance(head, Quantized) else linear(x, head)
    if vocab is not None and slots is not None and "A_lm_head" in vocab:
        logits = apply_lm_head(logits, x, vocab, slots)
    return softcap(logits, cfg.final_logit_softcap)


def kv_storage_dtype(dtype: Any, platform: str | None = None) -> Any:
    """The dtype the KV cache's pages are stored in for a model computing in ``dtype`` on ``platform``
    (None: JAX's default backend): ``dtype`` itself, except 16-bit floats on XLA:CPU, stored as their bits
    (``uint16``). XLA:CPU scatters a bf16/f16 array
    by converting all of it to f32 and back: three passes over every layer's pages each decode step
    (measured: 2/3 of a bf16 decode step of the bench model), where an integer scatter writes in place.
    Readers take :func:`_kv_view`, a bitcast XLA fuses into their gather."""
    dtype = jnp.dtype(dtype)
    on_cpu = (platform or jax.default_backend()) == "cpu"
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2 and on_cpu:
        return jnp.dtype(jnp.uint16)
    return dtype


def _kv_dtype(params: Params, pages: Array) -> Any:
    """The dtype the keys and values are in: the pages', or the model's where the pages store bits."""
    return params["embed"].dtype if pages.dtype == jnp.uint16 else pages.dtype


def _kv_view(pages: Array, dtype: Any) -> Array:
    """Stored pages -> the same pages in ``dtype`` (:func:`_kv_dtype`)."""
    return jax.lax.bitcast_convert_type(pages, dtype) if pages.dtype != dtype else pages


def _write_pages(pages: Array, flat_index: Array, x: Array, dtype: Any) -> Array:
    """pages ``[kv, N, P, D]``, flat_index ``[T]`` (page * P + offset), x ``[T, kv, D]`` -> pages with x's
    rows, in ``dtype`` (:func:`_kv_dtype`), written at those positions (as bits where pages store bits).

    Non-finite keys/values are stored as 0, so the cache only ever holds finite numbers: attention gives a
    masked position exactly 0 weight, but ``0 x NaN`` is NaN, and pages outlive their row (a freed page's
    tail, the null page that padding writes) — a row whose own adapter produced NaN would otherwise reach
    every later row that reads such a page (row isolation, docs/security.md). Finite rows are unchanged."""
    kv, n, p, d = pages.shape
    x = x.swapaxes(0, 1).astype(dtype)
    x = jnp.where(jnp.isfinite(x), x, jnp.zeros((), dtype))
    x = jax.lax.bitcast_convert_type(x, pages.dtype) if x.dtype != pages.dtype else x
    return pages.reshape(kv, n * p, d).at[:, flat_index].set(x).reshape(kv, n, p, d)


def key_block_pages(page_size: int, pages_per_row: int) -> int:
    """Pages per key block of the packed prefill's attention loop: 256 tokens' worth, at most a row."""
    return min(max(1, 256 // page_size), pages_per_row)


def _attend_blocks(
    cfg: ModelConfig,
    q: Array,  # [G, L, heads, D]
    k_pages: Array,
    v_pages: Array,
    tables: Array,  # [G, R'] with R' a multiple of `block`
    positions: Array,  # [G, L]
    key_blocks: Array,  # [] int32: blocks covering the longest segment's context
    block: int,
    sliding: bool,
) -> Array:
    """Each segment's queries over its own pages, ``block`` pages at a time with an online softmax
    (flash-attention style), for ``key_blocks`` blocks only: the cost follows the context the segments
    really have, not the longest context the worker allows. Returns ``[G, L, heads * D]``."""
    g, t = positions.shape
    kv, group, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    page = k_pages.shape[2]
    width = block * page
    qg = q.reshape(g, t, kv, group, d)

    def body(j, carry):
        m, denom, acc = carry
        cols = jax.lax.dynamic_slice_in_dim(tables, j * block, block, axis=1)  # [G, block]
        k = k_pages[:, cols].reshape(kv, g, width, d)
        v = v_pages[:, cols].reshape(kv, g, width, d)
        scores = _scores(cfg, jnp.einsum("gtkhd,kgsd->gkhts", qg, k, preferred_element_type=jnp.float32))
        key_pos = j * width + jnp.arange(width, dtype=jnp.int32)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [G, L, S]
        if sliding:
            mask = mask & (key_pos[None, None, :] > positions[:, :, None] - cfg.sliding_window)
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a query with no key yet stays at 0 weight
        p = jnp.exp(scores - shift[..., None])
        scale = jnp.exp(m - shift)
        denom = denom * scale + p.sum(axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("gkhts,kgsd->gkhtd", p.astype(v.dtype), v).astype(
            jnp.float32
        )
        return m_new, denom, acc

    init = (
        jnp.full((g, kv, group, t), -jnp.inf, jnp.float32),
        jnp.zeros((g, kv, group, t), jnp.float32),
        jnp.zeros((g, kv, group, t, d), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, key_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(g, t, cfg.q_size)


def prefill_packed(
    cfg: ModelConfig, backend: LoraBackend, state: DeviceState, batch: PrefillBatch
) -> tuple[Array, Cache]:
    """Prefill G sequences in one call (packed, each with its own adapter: SGMV-style segments); write
    their keys/values into their pages; returns each sequence's last-token logits ``[G, V]``.

    Semantics: per sequence g, causal self-attention over its positions ``0 .. starts[g] + lengths[g] - 1``
    (the first ``starts[g]`` read from its pages: a cached prefix; on sliding layers only the last
    ``sliding_window``), LoRA of ``slots[g]`` on every targeted projection. Padded tokens write to the
    null page and are never attended to by real ones.
    """
    h, cache = _prefill_hidden(cfg, backend, state, batch)
    return _last_logits(cfg, state, batch, h), cache


def prefill_scored(
    cfg: ModelConfig, backend: LoraBackend, state: DeviceState, batch: PrefillBatch
) -> tuple[Array, PromptScores, Cache]:
    """:func:`prefill_packed`, and the log-probabilities of ``batch.targets`` (prompt log-probabilities):
    at every position whose target is >= 0, ``token_logprobs`` of the logits there, i.e. of the next
    prompt token given the tokens up to that position. Computed only when some target is set (else
    zeros, at no cost but the test): the lm_head over every packed position is the expensive part."""
    assert batch.targets is not None
    h, cache = _prefill_hidden(cfg, backend, state, batch)
    g, t = batch.tokens.shape
    k = min(TOP_LOGPROBS, cfg.vocab_size)

    def scored() -> PromptScores:
        flat_slots = jnp.repeat(batch.slots, t)
        targets = jnp.maximum(batch.targets.reshape(g * t), 0)
        # a chunk of positions at a time: [chunk, V] logits, not [G*L, V]
        chunk = next(c for c in (256, 128, 64, 32, 16, 8, 4, 2, 1) if (g * t) % c == 0)

        def score_chunk(args: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            hc, sc, tc = args
            return token_logprobs(logits_from_hidden(cfg, state.params, hc, state.pools.vocab, sc), tc)

        parts = (h.reshape(-1, chunk, h.shape[-1]), flat_slots.reshape(-1, chunk), targets.reshape(-1, chunk))
        lp, ids, top = jax.lax.map(score_chunk, parts)
        return PromptScores(lp.reshape(g, t), ids.reshape(g, t, k), top.reshape(g, t, k))

    def none() -> PromptScores:
        return PromptScores(
            jnp.zeros((g, t), jnp.float32), jnp.zeros((g, t, k), jnp.int32), jnp.zeros((g, t, k), jnp.float32)
        )

    scores = jax.lax.cond(jnp.any(batch.targets >= 0), scored, none)
    return _last_logits(cfg, state, batch, h), scores, cache


def verify_logits(
    cfg: ModelConfig, backend: LoraBackend, state: DeviceState, batch: PrefillBatch
) -> tuple[Array, Cache]:
    """Speculative decoding's verify forward (``models.speculative``): G rows of L tokens each (a row's last
    token, then its drafts), continuing the rows' cached contexts, every row with its adapter; writes their
    keys/values and returns the logits at every position ``[G, L, V]``.

    Semantics: :func:`prefill_packed`'s (each row a sequence whose first ``starts[g]`` positions are in its
    pages), with the logits of every position instead of the last one's.
    """
    h, cache = _prefill_hidden(cfg, backend, state, batch)
    g, t = batch.tokens.shape
    logits = logits_from_hidden(cfg, state.params, h, state.pools.vocab, jnp.repeat(batch.slots, t))
    return logits.reshape(g, t, -1), cache


def _last_logits(cfg: ModelConfig, state: DeviceState, batch: PrefillBatch, h: Array) -> Array:
    """Each sequence's last real token's logits ``[G, V]`` from the packed hidden states ``[G*L, H]``."""
    g, t = batch.tokens.shape
    last = jnp.take_along_axis(h.reshape(g, t, -1), jnp.maximum(batch.lengths - 1, 0)[:, None, None], axis=1)[
        :, 0
    ]
    return logits_from_hidden(cfg, state.params, last, state.pools.vocab, batch.slots)


def _prefill_hidden(
    cfg: ModelConfig, backend: LoraBackend, state: DeviceState, batch: PrefillBatch
) -> tuple[Array, Cache]:
    """The packed prefill's layers: the final hidden state of every packed position ``[G*L, H]`` (before
    the final norm) and the cache with the batch's keys/values written."""
    params, lora, cache, inv_freq = state.params, state.pools.layers, state.cache, state.rope
    tokens, lengths, starts, slots = batch.tokens, batch.lengths, batch.starts, batch.slots
    page_tables, key_blocks = batch.page_tables, batch.key_blocks
    g, t = tokens.shape
    page = cache[0][0].shape[2]
    block = key_block_pages(page, page_tables.shape[1])
    pad = -page_tables.shape[1] % block
    tables = jnp.pad(page_tables, ((0, 0), (0, pad)))
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [G, L]
    real = jnp.arange(t)[None, :] < lengths[:, None]
    in_row = jnp.minimum(positions // page, page_tables.shape[1] - 1)
    flat_index = jnp.take_along_axis(page_tables, in_row, axis=1) * page + positions % page
    flat_index = jnp.where(real, flat_index, positions % page).reshape(g * t)

    def lora_fn(
        y: Array, x: Array, ll: dict[str, Array], group: str, parallel: str, bias: Array | None
    ) -> Array:
        y = backend.apply_segments(y, x, *_group_pools(ll, group), slots, parallel)
        return apply_vectors(y, ll, group, slots, bias)

    flat_pos = positions.reshape(g * t)
    token_slots = jnp.repeat(slots, t)  # [G*L]
    kv_dtype = _kv_dtype(params, cache[0][0])
    h = _embed(cfg, params, tokens.reshape(g * t), state.pools.vocab, slots)
    new_cache: Cache = []
    for n, (lp, ll, (k_pages, v_pages)) in enumerate(zip(params["layers"], lora, cache, strict=True)):
        q, k, v = _qkv(cfg, lp, ll, h, lora_fn, backend.shards)  # [G*L, heads, D]
        freq = layer_inv_freq(cfg, inv_freq, n)
        q, k = apply_rope(q, flat_pos, freq), apply_rope(k, flat_pos, freq)
        k_pages = _write_pages(k_pages, flat_index, k, kv_dtype)
        v_pages = _write_pages(v_pages, flat_index, v, kv_dtype)
        q = q.reshape(g, t, cfg.num_heads, cfg.head_dim)
        attn = _attend_blocks(
            cfg,
            q,
            _kv_view(k_pages, kv_dtype),
            _kv_view(v_pages, kv_dtype),
            tables,
            positions,
            key_blocks,
            block,
            cfg.is_sliding(n),
        ).reshape(g * t, cfg.q_size)
        h = _out_proj(lp, ll, h, attn, lora_fn, cfg)
        h = _layer_mlp(cfg, lp, ll, h, lora_fn, backend.shards, token_slots, getattr(backend, "mesh", None))
        new_cache.append((k_pages, v_pages))
    return h, new_cache


def whole_row_key_blocks(page_size: int, pages_per_row: int) -> int:
    """``PrefillBatch.key_blocks`` covering a row's every page: a one-sequence prefill that need not know
    how long the row's context is (tests, benchmarks)."""
    return -(-pages_per_row // key_block_pages(page_size, pages_per_row))


def decode(
    cfg: ModelConfig,
    backend: LoraBackend,
    state: DeviceState,
    batch: DecodeBatch,
    attention: str | DecodeAttention = "xla",
) -> tuple[Array, Cache]:
    """One decode step for every row; returns logits [B, V] and the cache with each row's new k/v.

    Semantics: row b writes its token's key/value at ``positions[b]`` of its pages and attends to its
    positions 0..positions[b] (on sliding layers only the last ``sliding_window`` of them; the pages keep
    every position), with the adapter ``plan`` gives it (``backend.plan(slots)``; none for every row when
    ``plan`` is None, which compiles no LoRA code at all). Idle rows have all-null page tables.
    ``attention``: how the paged attention runs (``kernels.attention``: ``"xla"``, ``"pallas"`` or a
    ``DecodeAttention``; a sharded ``backend``'s mesh is used for the Pallas kernel).
    """
    params, lora, cache, inv_freq = state.params, state.pools.layers, state.cache, state.rope
    tokens, positions, page_tables, plan = batch.tokens, batch.positions, batch.page_tables, batch.plan
    b = page_tables.shape[0]
    page = cache[0][0].shape[2]
    attend = DecodeAttention.of(attention, backend)
    flat_index = jnp.take_along_axis(page_tables, (positions // page)[:, None], axis=1)[:, 0] * page
    flat_index = flat_index + positions % page

    rows = None if plan is None else backend.row_slots(plan)  # [B] int32 slot per row, -1 = none

    def lora_fn(
        y: Array, x: Array, ll: dict[str, Array], group: str, parallel: str, bias: Array | None
    ) -> Array:
        if plan is None:
            return y
        y = backend.apply_decode(y, x, *_group_pools(ll, group), plan, parallel)
        return apply_vectors(y, ll, group, rows, bias)

    h = _embed(cfg, params, tokens, state.pools.vocab, rows)
    kv_dtype = _kv_dtype(params, cache[0][0])
    new_cache: Cache = []
    for n, (lp, ll, (k_pages, v_pages)) in enumerate(zip(params["layers"], lora, cache, strict=True)):
        q, k, v = _qkv(cfg, lp, ll, h, lora_fn, backend.shards)  # [B, heads, D]
        freq = layer_inv_freq(cfg, inv_freq, n)
        q = apply_rope(q[:, None], positions[:, None], freq)[:, 0]
        k = apply_rope(k[:, None], positions[:, None], freq)[:, 0]
        k_pages = _write_pages(k_pages, flat_index, k, kv_dtype)
        v_pages = _write_pages(v_pages, flat_index, v, kv_dtype)
        window = cfg.sliding_window if cfg.is_sliding(n) else None
        keys, values = (
            (k_pages, v_pages)
            if attend.reads_bits
            else (_kv_view(k_pages, kv_dtype), _kv_view(v_pages, kv_dtype))
        )
        attn = attend(
            q, keys, values, positions, page_tables,
            scale=cfg.attn_scale, softcap=cfg.attn_logit_softcap, window=window,
        ).reshape(b, cfg.q_size)  # fmt: skip
        h = _out_proj(lp, ll, h, attn, lora_fn, cfg)
        h = _layer_mlp(cfg, lp, ll, h, lora_fn, backend.shards, rows, getattr(backend, "mesh", None))
        new_cache.append((k_pages, v_pages))
    return logits_from_hidden(cfg, params, h, state.pools.vocab, rows), new_cache


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any) -> Cache:
    """Zeroed paged KV cache, per layer ``(k_pages, v_pages)``, each ``[kv_heads, num_pages, page_size,
    head_dim]`` (the layout of JAX's TPU paged-attention kernels; tensor parallelism splits axis 0).
    Page 0 is the null page: never allocated, the target of idle rows' and padding's writes. Stored in
    :func:`kv_storage_dtype` of ``dtype``."""
    shape, stored = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim), kv_storage_dtype(dtype)
    return [(jnp.zeros(shape, stored), jnp.zeros(shape, stored)) for _ in range(cfg.num_layers)]


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype: Any) -> int:
    """Bytes one page costs across every layer (keys and values)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim * jnp.dtype(dtype).itemsize


def contiguous_page_tables(rows: int, pages_per_row: int) -> np.ndarray:
    """``[rows, pages_per_row]`` tables giving row r the pages ``1 + r * pages_per_row ..``: a dense
    cache's layout, for tests and benchmarks that drive the model without the page manager."""
    return (1 + np.arange(rows * pages_per_row, dtype=np.int32)).reshape(rows, pages_per_row)
