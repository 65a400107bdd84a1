"""A mixture-of-experts MLP block: route each token to ``k`` of ``E`` experts, run only those, add them up.

Semantics (transformers' Qwen3-MoE / Mixtral / Qwen2-MoE blocks): ``logits = x @ router.T`` in the model's
dtype; ``p = softmax(logits)`` in f32; the ``k`` largest ``p`` and their experts; divided by their sum when
``norm_topk_prob`` (Mixtral always); then cast to the model's dtype (Mixtral keeps them f32 while scaling).
Expert ``e`` computes ``down_e(act(gate_e x) * up_e x)``; a token's output is the sum of its experts'
outputs times their weights, added in ascending expert order into zeros (the order transformers' loop over
experts adds them in). Qwen2-MoE adds a shared expert every token takes, times ``sigmoid(x @ shared_gate.T)``.

Only the chosen experts are computed; no capacity, no dropped tokens, and a token's result depends on its
own hidden state only, not on the other tokens of the batch or the experts they chose (batch-invariant
for a given number of tokens, as the model's other matmuls are). ``jax.lax.platform_dependent`` picks the
way when the step is lowered (a TPU program exported on a CPU host is TPU's); all compute the same thing and
the tests hold them together:

* ``tiled`` (CPU): for each matmul the (token, choice) pairs sorted by expert and cut into tiles of at
  most ``TILE_ROWS`` rows of one expert, each tile one matmul with its expert's weights, empty tiles
  skipped: an expert's weights are read once per tile of it. XLA:CPU lowers ``ragged_dot`` to a masked
  product over every expert, and gathering each pair's expert weights copies them per pair: measured on
  the bench's shapes (hidden 1024, 32 experts of 512, top-4, one layer), 16 tokens take 13 ms tiled, 44
  ragged, 161 gathered; 1024 tokens 158 ms tiled, 4 s ragged.
* ``ragged`` (TPU, GPU): the pairs sorted by expert, one ``jax.lax.ragged_dot`` per matmul over the groups
  (the grouped matmul XLA lowers to the MXU), then unsorted.
* ``gather``: each pair multiplies its expert's weights, gathered in chunks (a reference for the tests).

Over a ``model`` mesh of N devices (expert parallelism, :func:`_expert_parallel`) each device holds E/N
experts and their LoRA pools, computes the pairs whose expert it holds, and one all-reduce adds the parts.

LoRA on the experts and the router (``adapters.peft_experts``; pools of ``expert_slot_shapes``, present on
every mixture-of-experts model): a token with adapter slot s that chose expert e adds ``(x A[e, s]) B[e, s]``
to that expert's gate/up output, and ``(act A'[e, s]) B'[e, s]`` to its down output, before the weighting;
its router logits gain ``(x RA[s]) RB[s]``. The expert pools are expert-major, ``[E, S, …]``: on CPU a
decode step's pairs run through the ``cpu`` backend's grouped C++ kernels with the pools seen as ``E * S``
slots (each (expert, slot)'s A and B read once, in place; where the kernels do not run, each pair gathers
its own ``A[e, s]`` and ``B[e, s]``), a prefill's run as tiles of one (expert, slot); the grouped path
sorts the pairs by ``e * S + s`` (an order also sorted by expert, so the base's groups stay the same) and
runs the shrink and expand as grouped matmuls over the ``E * S`` (expert, slot) groups: a step reads only
the experts and slots its tokens chose. Dtypes as the dense backends': the shrink accumulates in f32 and
rounds to the model's dtype, the expand accumulates in f32 into the expert's f32 output. A token without an
adapter (slot -1) computes slot 0's delta times an exact zero, so its rows are its own whatever the others
hold; the router's delta is a one-hot sum over slots, each other slot's term exactly zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from loraserve.kernels.linear import linear
from loraserve.kernels.shapes import operand_precision
from loraserve.models.config import ModelConfig
from loraserve.models.layers import activation

Array = jax.Array
# (token, choice) pairs per gathered chunk: bounds the gathered expert weights (chunk × one expert's)
GATHER_PAIRS = 64
# the most rows a tile of the CPU's tiled path holds (rows of one expert, or of one expert and slot)
TILE_ROWS = 64
# (token, choice) pairs up to which the tiled path gathers each pair's LoRA (a decode step's)
GATHER_LORA_PAIRS = 256
# LoRA pools of a mixture of experts (per layer; ``expert_slot_shapes``): expert-major ``[E, S, …]``
# ``EA/EB_gate_up``, ``EA/EB_down``, slot-major ``RA [S, hidden, R]``, ``RB [S, R, E]`` for the router
EXPERT_POOLS = ("EA_gate_up", "EB_gate_up", "EA_down", "EB_down")
ROUTER_POOLS = ("RA", "RB")


def expert_slot_shapes(cfg: ModelConfig, max_rank: int) -> dict[str, tuple[int, ...]]:
    """Pool name -> one slot's value (the slot axis left out): ``EA_gate_up [E, H, R]``, ``EB_gate_up
    [E, R, 2I]``, ``EA_down [E, I, R]``, ``EB_down [E, R, H]``, ``RA [H, R]``, ``RB [R, E]``; none for a
    dense model."""
    if not cfg.is_moe:
        return {}
    e, h, i, r = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, max_rank
    return {
        "EA_gate_up": (e, h, r),
        "EB_gate_up": (e, r, 2 * i),
        "EA_down": (e, i, r),
        "EB_down": (e, r, h),
        "RA": (h, r),
        "RB": (r, e),
    }


def is_expert_pool(name: str) -> bool:
    """Whether ``name`` is an expert-major pool (``[E, S, …]``: a slot is ``pool[:, s]``)."""
    return name in EXPERT_POOLS


def is_moe_pool(name: str) -> bool:
    """Whether ``name`` is one of ``expert_slot_shapes``' pools (canonical layout on every backend)."""
    return name in EXPERT_POOLS or name in ROUTER_POOLS


def init_expert_pools(cfg: ModelConfig, max_loras: int, max_rank: int, dtype: Any) -> dict[str, Array]:
    """One layer's zeroed pools of ``expert_slot_shapes`` with the slot axis in place."""
    out = {}
    for name, shape in expert_slot_shapes(cfg, max_rank).items():
        full = (shape[0], max_loras, *shape[1:]) if is_expert_pool(name) else (max_loras, *shape)
        out[name] = jnp.zeros(full, dtype)
    return out


def expert_slot_values(cfg: ModelConfig, experts: dict[str, tuple[Any, Any]], max_rank: int) -> list[dict]:
    """Per layer, one slot's host arrays of ``expert_slot_shapes`` from ``LoraWeights.experts``, rank
    zero-padded to ``max_rank`` (targets the adapter leaves out: zeros)."""
    import numpy as np

    shapes = expert_slot_shapes(cfg, max_rank)
    names = {"experts.gate_up_proj": "gate_up", "experts.down_proj": "down", "router": None}
    out = []
    for layer in range(cfg.num_layers):
        values = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
        for target, (a, b) in experts.items():
            group = names[target]
            a_name, b_name = ("RA", "RB") if group is None else (f"EA_{group}", f"EB_{group}")
            r = a.shape[-1]
            values[a_name][..., :r] = a[layer]
            values[b_name][..., :r, :] = b[layer]
        out.append(values)
    return out


def _router_delta(ll: dict[str, Array], x: Array, slots: Array) -> Array:
    """``[T, E]`` f32: each token's router LoRA, ``(x RA[s]) RB[s]``, as a one-hot sum over the slots."""
    a, b = ll["RA"], ll["RB"]  # [S, H, R], [S, R, E]
    onehot = (slots[:, None] == jnp.arange(a.shape[0])[None, :]).astype(jnp.float32)  # [T, S]
    t = jnp.einsum("th,shr->tsr", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    t = t.astype(x.dtype).astype(jnp.float32) * onehot[:, :, None]
    return jnp.einsum("tsr,sre->te", t, b.astype(jnp.float32))


def route(
    cfg: ModelConfig, router: Array, x: Array, ll: dict[str, Array] | None = None, slots: Array | None = None
) -> tuple[Array, Array]:
    """``x [T, H]`` -> (the experts ``[T, k]`` int32 in ascending order per token, their weights ``[T, k]``);
    with ``ll``'s router pools and per-token ``slots`` the router's LoRA joins the logits."""
    logits = linear(x, router)  # [T, E] f32, as the router's Linear computes it
    if ll is not None and slots is not None:
        logits = logits + _router_delta(ll, x, slots)
    logits = logits.astype(x.dtype)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.experts_per_token)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if not cfg.routing_in_f32:
        weights = weights.astype(x.dtype)
    order = jnp.argsort(experts, axis=-1)  # the order the experts' outputs are added in
    return jnp.take_along_axis(experts, order, -1), jnp.take_along_axis(weights, order, -1)


def _act(cfg: ModelConfig, gu: Array, dtype: Any) -> Array:

    gate, up = jnp.split(gu.astype(dtype), 2, axis=-1)
    return activation(cfg, gate).astype(dtype) * up


def _combine(down: Array, weights: Array, dtype: Any) -> Array:
    """``down [T, k, H]`` scaled by ``weights [T, k]``, summed over k in order, in ``dtype``."""
    scaled = (down * weights[..., None]).astype(dtype)
    out = jnp.zeros(scaled.shape[::2], dtype)
    for j in range(scaled.shape[1]):  # static k: the sum's order is transformers' (ascending expert)
        out = out + scaled[:, j]
    return out


Pools = dict[str, Array]  # one layer's expert LoRA pools (EXPERT_POOLS), or empty: no LoRA on experts


def _gathered_delta(pools: Pools, group: str, x: Array, ec: Array, sc: Array) -> Array:
    """``[C, k, out]`` f32: each (token, choice)'s LoRA of expert ``ec`` with the token's slot ``sc``
    (``-1``: an exact zero)."""
    s = jnp.maximum(sc, 0)[:, None]  # [C, 1]
    a, b = pools[f"EA_{group}"][ec, s], pools[f"EB_{group}"][ec, s]  # [C, k, in, R], [C, k, R, out]
    eq = "ch,ckhr->ckr" if x.ndim == 2 else "ckh,ckhr->ckr"
    t = jnp.einsum(eq, x, a.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    d = jnp.einsum("ckr,ckro->cko", t.astype(jnp.float32), b.astype(jnp.float32))
    return d * (sc >= 0).astype(jnp.float32)[:, None, None]


def _gathered(
    cfg: ModelConfig,
    lp: dict[str, Array],
    pools: Pools,
    x: Array,
    experts: Array,
    weights: Array,
    slots: Array,
) -> Array:
    t, k = experts.shape
    chunk = max(1, GATHER_PAIRS // k)

    def one(args: tuple[Array, Array, Array, Array]) -> Array:
        xc, ec, wc, sc = args  # [C, H], [C, k], [C, k], [C]
        gu = jnp.einsum("ch,ckhn->ckn", xc, lp["experts_gate_up"][ec], preferred_element_type=jnp.float32)
        if pools:
            gu = gu + _gathered_delta(pools, "gate_up", xc, ec, sc)
        act = _act(cfg, gu, x.dtype)
        down = jnp.einsum("ckn,cknh->ckh", act, lp["experts_down"][ec], preferred_element_type=jnp.float32)
        if pools:
            down = down + _gathered_delta(pools, "down", act, ec, sc)
        return _combine(down.astype(x.dtype), wc, x.dtype)

    if t <= chunk:
        return one((x, experts, weights, slots))
    pad = -t % chunk
    xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, chunk, x.shape[1])
    es = jnp.pad(experts, ((0, pad), (0, 0))).reshape(-1, chunk, k)
    ws = jnp.pad(weights, ((0, pad), (0, 0))).reshape(-1, chunk, k)
    ss = jnp.pad(slots, (0, pad), constant_values=-1).reshape(-1, chunk)
    return jax.lax.map(one, (xs, es, ws, ss)).reshape(-1, x.shape[1])[:t]


def _tiled(
    cfg: ModelConfig,
    lp: dict[str, Array],
    pools: Pools,
    x: Array,
    experts: Array,
    weights: Array,
    slots: Array,
) -> Array:
    """The CPU's path: each matmul over the (token, choice) pairs as tiles of rows that share an expert
    (:func:`_grouped`), so an expert's weights are read once per tile of it instead of once per pair (the
    gathered path's); the LoRA beside them (:func:`_lora`)."""
    t, k = experts.shape
    pairs, e = t * k, experts.reshape(-1)
    s = jnp.repeat(slots, k)
    xs = x[jnp.arange(pairs) // k]  # [pairs, H]
    rows = _tile_rows(pairs, cfg.num_experts)

    def base(w: Array) -> Callable[[Array, Array], Array]:
        return lambda xt, g: jnp.einsum("rh,hn->rn", xt, w[g], preferred_element_type=jnp.float32)

    gu = _grouped(base(lp["experts_gate_up"]), xs, e, cfg.num_experts, lp["experts_gate_up"].shape[2], rows)
    if pools:
        gu = gu + _lora(pools, "gate_up", xs, e, s, rows)
    act = _act(cfg, gu, x.dtype)
    down = _grouped(base(lp["experts_down"]), act, e, cfg.num_experts, x.shape[1], rows)
    if pools:
        down = down + _lora(pools, "down", act, e, s, rows)
    return _combine(down.astype(x.dtype).reshape(t, k, -1), weights, x.dtype)


def _tile_rows(pairs: int, groups: int) -> int:
    """Rows a tile holds: about a group's share of the pairs (a decode step: a few), a power of two in
    [8, TILE_ROWS]."""
    return min(TILE_ROWS, max(8, 1 << max(0, -(-pairs // groups) - 1).bit_length()))


def _grouped(
    fn: Callable[[Array, Array], Array], xs: Array, key: Array, groups: int, out: int, rows: int
) -> Array:
    """``[pairs, out]`` f32 in the pairs' order: ``fn(x_tile, g)`` over tiles of at most ``rows`` rows whose
    ``key`` is ``g``. The rows sorted by key; a tile starts at every ``rows``-th sorted row and at every
    key's first, so there are at most ``ceil(pairs / rows) + groups`` of them, empty ones skipped; each
    row is computed by exactly one tile and written into zeros (its bits are its own)."""
    pairs = xs.shape[0]
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    sizes = jnp.bincount(key, length=groups)
    firsts = jnp.where(sizes > 0, jnp.cumsum(sizes) - sizes, pairs)  # a key's first sorted row (or none)
    blocks = -(-pairs // rows)
    starts = jnp.sort(jnp.concatenate([jnp.arange(blocks, dtype=firsts.dtype) * rows, firsts]))
    ends = jnp.minimum(jnp.concatenate([starts[1:], jnp.full((1,), pairs, starts.dtype)]), pairs)
    tile_key = sorted_key[jnp.minimum(starts, pairs - 1)]
    padded = jnp.pad(xs[order], ((0, rows), (0, 0)))  # a tile's slice never runs past the end

    def tile(i: Array) -> Array:
        count = jnp.maximum(ends[i] - starts[i], 0)

        def compute() -> Array:
            y = fn(jax.lax.dynamic_slice_in_dim(padded, starts[i], rows), tile_key[i])
            return jnp.where((jnp.arange(rows) < count)[:, None], y, 0.0)

        return jax.lax.cond(count > 0, compute, lambda: jnp.zeros((rows, out), jnp.float32))

    outs = jax.lax.map(tile, jnp.arange(starts.shape[0]))  # [tiles, rows, out]
    at = starts[:, None] + jnp.arange(rows)[None, :]
    at = jnp.where(jnp.arange(rows)[None, :] < (ends - starts)[:, None], at, pairs)  # padding -> a spare row
    y = jnp.zeros((pairs + 1, out), jnp.float32).at[at.reshape(-1)].add(outs.reshape(-1, out))
    return y[:pairs][jnp.argsort(order)]


def _lora(pools: Pools, group: str, xs: Array, e: Array, s: Array, rows: int) -> Array:
    """``[pairs, out]`` f32: each pair's LoRA of its expert ``e`` and slot ``s`` (-1: an exact zero). Up to
    ``GATHER_LORA_PAIRS`` pairs (a decode step): the C++ grouped kernels where they run
    (:func:`_kernel_delta`), else each pair gathers its own A and B; past that (a prefill) tiles of one
    (expert, slot) run it (:func:`_grouped`)."""
    if xs.shape[0] <= GATHER_LORA_PAIRS:
        if _kernels_serve(pools[f"EA_{group}"].dtype):
            return _kernel_delta(pools, group, xs, e, s)
        return _gathered_delta(pools, group, xs[:, None, :], e[:, None], s)[:, 0]
    n_slots = pools[f"EA_{group}"].shape[1]
    key = e * n_slots + jnp.maximum(s, 0)
    out = pools[f"EB_{group}"].shape[-1]

    def fn(xt: Array, g: Array) -> Array:
        return _tile_delta(pools, group, xt, g // n_slots, g % n_slots)

    d = _grouped(fn, xs, key, pools[f"EA_{group}"].shape[0] * n_slots, out, rows)
    return d * (s >= 0).astype(jnp.float32)[:, None]


def _kernels_serve(pool_dtype: Any) -> bool:
    """Whether :func:`_kernel_delta` runs here: the C++ kernels build and load, and take the pools' dtype."""
    from loraserve.kernels import cpu

    return jnp.dtype(pool_dtype) in cpu.POOL_DTYPES and cpu.available()


def _kernel_delta(pools: Pools, group: str, xs: Array, e: Array, s: Array) -> Array:
    """``[pairs, out]`` f32: :func:`_gathered_delta`'s values through the ``cpu`` backend's grouped shrink and
    expand (``kernels/csrc/lora.cc``) over the pools seen as ``E * S`` slots, pair ``(e, s)`` reading slot
    ``e * S + s``: the kernels group the pairs by it and read each (expert, slot)'s A and B once, in place,
    where the gathered path copies them for every pair (a decode step of the bench's MoE: ~64 pairs, most of
    them distinct). The shrink is rounded to the activations' dtype between the two, as on the other paths; a
    pair without an adapter (``s = -1``) gets an exact zero."""
    from loraserve.kernels import cpu

    a, b = pools[f"EA_{group}"], pools[f"EB_{group}"]  # [E, S, in, R], [E, S, R, out]
    n_slots = a.shape[1]
    idx = jnp.where(s >= 0, e * n_slots + s, -1).astype(jnp.int32)
    t = cpu.lora_shrink(xs, a.reshape(-1, *a.shape[2:]), idx)  # [pairs, R] in xs's dtype
    zeros = jnp.zeros((xs.shape[0], b.shape[-1]), jnp.float32)
    return cpu.lora_expand(t, b.reshape(-1, *b.shape[2:]), idx, zeros)


def _tile_delta(pools: Pools, group: str, x: Array, e: Array, s: Array) -> Array:
    """``[rows, out]`` f32: one tile's LoRA, ``(x A[e, s]) B[e, s]`` (the dtypes as the gathered path's)."""
    a, b = pools[f"EA_{group}"][e, s], pools[f"EB_{group}"][e, s]
    t = jnp.einsum("rh,hk->rk", x, a.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum("rk,ko->ro", t.astype(jnp.float32), b.astype(jnp.float32))


def _ragged_dot(lhs: Array, rhs: Array, sizes: Array) -> Array:
    """``jax.lax.ragged_dot`` in f32, bf16 operands at ``DEFAULT`` precision (``kernels.shapes.operand_precision``:
    on a TPU it lowers to a Mosaic kernel, which refuses a float32 contract precision on bf16 operands)."""
    return jax.lax.ragged_dot(
        lhs, rhs, sizes, precision=operand_precision(lhs, rhs), preferred_element_type=jnp.float32
    )


def _ragged_delta(pools: Pools, group: str, xs: Array, sizes: Array, on: Array) -> Array:
    """``[P, out]`` f32: the sorted pairs' LoRA as grouped matmuls over the ``E * S`` (expert, slot) groups."""
    a, b = pools[f"EA_{group}"], pools[f"EB_{group}"]  # [E, S, in, R], [E, S, R, out]
    a = a.reshape(-1, *a.shape[2:]).astype(xs.dtype)
    t = _ragged_dot(xs, a, sizes).astype(xs.dtype)
    d = _ragged_dot(t, b.reshape(-1, *b.shape[2:]).astype(xs.dtype), sizes)
    return d * on[:, None]


def _ragged(
    cfg: ModelConfig,
    lp: dict[str, Array],
    pools: Pools,
    x: Array,
    experts: Array,
    weights: Array,
    slots: Array,
) -> Array:
    t, k = experts.shape
    flat = experts.reshape(-1)
    slot_of = jnp.repeat(slots, k)  # [T*k] each pair's slot
    if pools:  # sorted by (expert, slot): still sorted by expert
        n_slots = pools["EA_gate_up"].shape[1]
        group = flat * n_slots + jnp.maximum(slot_of, 0)
        order = jnp.argsort(group, stable=True)
        lora_sizes = jnp.bincount(group, length=cfg.num_experts * n_slots).astype(jnp.int32)
        on = (slot_of >= 0).astype(jnp.float32)[order]
    else:
        order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    xs = x[order // k]
    gu = _ragged_dot(xs, lp["experts_gate_up"], sizes)
    if pools:
        gu = gu + _ragged_delta(pools, "gate_up", xs, lora_sizes, on)
    act = _act(cfg, gu, x.dtype)
    down = _ragged_dot(act, lp["experts_down"], sizes)
    if pools:
        down = down + _ragged_delta(pools, "down", act, lora_sizes, on)
    unsorted = down.astype(x.dtype)[jnp.argsort(order)].reshape(t, k, -1)
    return _combine(unsorted, weights, x.dtype)


def _experts(
    cfg: ModelConfig, path: str, lp: dict[str, Array], pools: Pools, x: Array, e: Array, w: Array, s: Array
) -> Array:
    """The routed experts' weighted sum by ``path`` (``auto``: by the platform the step is lowered for, so a
    TPU program exported on a CPU host is TPU's)."""
    if path == "auto":
        return jax.lax.platform_dependent(
            lp, pools, x, e, w, s, cpu=partial(_tiled, cfg), default=partial(_ragged, cfg)
        )
    return {"gather": _gathered, "tiled": _tiled, "ragged": _ragged}[path](cfg, lp, pools, x, e, w, s)


def _expert_parallel(
    cfg: ModelConfig,
    path: str,
    mesh: Any,
    lp: dict[str, Array],
    pools: Pools,
    x: Array,
    e: Array,
    w: Array,
    s: Array,
) -> Array:
    """Expert parallelism: device d of the ``model`` axis holds experts ``d*E/N .. (d+1)*E/N - 1`` (and their
    LoRA pools); every device routes every token (replicated), computes the pairs whose expert it holds
    (the others' weights set to an exact zero), and one all-reduce of ``[T, H]`` adds the devices' parts."""
    from loraserve.kernels.sharded import AXIS

    n = mesh.shape[AXIS]
    local_cfg = dataclasses.replace(cfg, num_experts=cfg.num_experts // n)
    held = {"experts_gate_up": lp["experts_gate_up"], "experts_down": lp["experts_down"]}

    def local(held: dict[str, Array], pools: Pools, x: Array, e: Array, w: Array, s: Array) -> Array:
        first = jax.lax.axis_index(AXIS) * local_cfg.num_experts
        mine = (e >= first) & (e < first + local_cfg.num_experts)
        e_local = jnp.clip(e - first, 0, local_cfg.num_experts - 1)
        part = _experts(local_cfg, path, held, pools, x, e_local, jnp.where(mine, w, 0).astype(w.dtype), s)
        return jax.lax.psum(part, AXIS)

    split = jax.sharding.PartitionSpec(AXIS)
    whole = jax.sharding.PartitionSpec()
    specs = ({k: split for k in held}, {k: split for k in pools}, whole, whole, whole, whole)
    run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=whole, check_vma=False)
    return run(held, pools, x, e, w, s)


def moe_mlp(
    cfg: ModelConfig,
    lp: dict[str, Array],
    x: Array,
    path: str = "auto",
    ll: dict[str, Array] | None = None,
    slots: Array | None = None,
    mesh: Any = None,
) -> Array:
    """The block's output for the normed hidden states ``x [T, H]`` (module doc). ``path``: ``auto``,
    ``gather`` or ``ragged``. ``ll``: the layer's LoRA pools; ``slots [T]``: each token's adapter slot
    (-1: none); without them (or without expert pools in ``ll``) no LoRA is computed. ``mesh``: a
    ``model`` mesh of N > 1 devices to split the experts over (:func:`_expert_parallel`)."""
    lora = slots is not None and ll is not None and "EA_gate_up" in ll
    pools: Pools = {k: ll[k] for k in EXPERT_POOLS} if lora and ll is not None else {}
    token_slots = slots if slots is not None and lora else jnp.full(x.shape[:1], -1, jnp.int32)
    experts, weights = route(cfg, lp["router"], x, ll if lora else None, token_slots if lora else None)
    if mesh is not None and mesh.size > 1:
        out = _expert_parallel(cfg, path, mesh, lp, pools, x, experts, weights, token_slots)
    else:
        out = _experts(cfg, path, lp, pools, x, experts, weights, token_slots)
    if cfg.shared_expert_size:
        shared = linear(_act(cfg, linear(x, lp["shared_gate_up"]), x.dtype), lp["shared_down"]).astype(
            x.dtype
        )
        gate = jax.nn.sigmoid(linear(x, lp["shared_gate"]).astype(x.dtype))
        out = out + gate * shared
    return out
