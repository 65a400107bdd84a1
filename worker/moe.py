"""A mixture-of-experts MLP block: route each token to ``k`` of ``E`` experts, run only those, add them up.

Semantics (transformers' Qwen3-MoE / Mixtral / Qwen2-MoE blocks): ``logits = x @ router.T`` in the model's
dtype; ``p = softmax(logits)`` in f32; the ``k`` largest ``p`` and their experts; divided by their sum when
``norm_topk_prob`` (Mixtral always); then cast to the model's dtype (Mixtral keeps them f32 while scaling).
Expert ``e`` computes ``down_e(act(gate_e x) * up_e x)``; a token's output is the sum of its experts'
outputs times their weights, added in ascending expert order into zeros (the order transformers' loop over
experts adds them in). Qwen2-MoE adds a shared expert every token takes, times ``sigmoid(x @ shared_gate.T)``.

Only the chosen experts are computed; no capacity, no dropped tokens, and a token's result depends on its
own hidden state only, not on the other tokens of the batch or the experts they chose (batch-invariant
for a given number of tokens, as the model's other matmuls are). Two ways, picked by platform at trace time (both compute the same
thing; tests run both; ``jax.lax.platform_dependent`` picks one when the step is lowered):

* ``gather`` (CPU): each (token, choice) multiplies the weights of its expert, gathered in chunks of a
  few tokens, so a decode step reads the experts its rows chose and nothing else. XLA:CPU lowers
  ``ragged_dot`` to a masked product over every expert (measured as slow as the dense all-experts
  product), which is what this avoids.
* ``ragged`` (TPU, GPU): the (token, choice) pairs sorted by expert, one ``jax.lax.ragged_dot`` per
  matmul over the groups (the grouped matmul XLA lowers to the MXU), then unsorted.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from loraserve.kernels.linear import linear
from loraserve.worker.model_config import ModelConfig

Array = jax.Array
# (token, choice) pairs per gathered chunk: bounds the gathered expert weights (chunk × one expert's)
GATHER_PAIRS = 64


def route(cfg: ModelConfig, router: Array, x: Array) -> tuple[Array, Array]:
    """``x [T, H]`` -> (the experts ``[T, k]`` int32 in ascending order per token, their weights ``[T, k]``)."""
    logits = linear(x, router).astype(x.dtype)  # [T, E], as the router's Linear computes it
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.experts_per_token)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if not cfg.routing_in_f32:
        weights = weights.astype(x.dtype)
    order = jnp.argsort(experts, axis=-1)  # the order the experts' outputs are added in
    return jnp.take_along_axis(experts, order, -1), jnp.take_along_axis(weights, order, -1)


def _act(cfg: ModelConfig, gu: Array, dtype: Any) -> Array:
    from loraserve.worker.model import _activation  # the dense MLP's activation, shared

    gate, up = jnp.split(gu.astype(dtype), 2, axis=-1)
    return _activation(cfg, gate).astype(dtype) * up


def _combine(down: Array, weights: Array, dtype: Any) -> Array:
    """``down [T, k, H]`` scaled by ``weights [T, k]``, summed over k in order, in ``dtype``."""
    scaled = (down * weights[..., None]).astype(dtype)
    out = jnp.zeros(scaled.shape[::2], dtype)
    for j in range(scaled.shape[1]):  # static k: the sum's order is transformers' (ascending expert)
        out = out + scaled[:, j]
    return out


def _gathered(cfg: ModelConfig, lp: dict[str, Array], x: Array, experts: Array, weights: Array) -> Array:
    t, k = experts.shape
    chunk = max(1, GATHER_PAIRS // k)

    def one(args: tuple[Array, Array, Array]) -> Array:
        xc, ec, wc = args  # [C, H], [C, k], [C, k]
        gu = jnp.einsum("ch,ckhn->ckn", xc, lp["experts_gate_up"][ec], preferred_element_type=jnp.float32)
        act = _act(cfg, gu, x.dtype)
        down = jnp.einsum("ckn,cknh->ckh", act, lp["experts_down"][ec], preferred_element_type=jnp.float32)
        return _combine(down.astype(x.dtype), wc, x.dtype)

    if t <= chunk:
        return one((x, experts, weights))
    pad = -t % chunk
    xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, chunk, x.shape[1])
    es = jnp.pad(experts, ((0, pad), (0, 0))).reshape(-1, chunk, k)
    ws = jnp.pad(weights, ((0, pad), (0, 0))).reshape(-1, chunk, k)
    return jax.lax.map(one, (xs, es, ws)).reshape(-1, x.shape[1])[:t]


def _ragged(cfg: ModelConfig, lp: dict[str, Array], x: Array, experts: Array, weights: Array) -> Array:
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    xs = x[order // k]
    gu = jax.lax.ragged_dot(xs, lp["experts_gate_up"], sizes, preferred_element_type=jnp.float32)
    act = _act(cfg, gu, x.dtype)
    down = jax.lax.ragged_dot(act, lp["experts_down"], sizes, preferred_element_type=jnp.float32)
    unsorted = down.astype(x.dtype)[jnp.argsort(order)].reshape(t, k, -1)
    return _combine(unsorted, weights, x.dtype)


def moe_mlp(cfg: ModelConfig, lp: dict[str, Array], x: Array, path: str = "auto") -> Array:
    """The block's output for the normed hidden states ``x [T, H]`` (module doc). ``path``: ``auto``,
    ``gather`` or ``ragged``."""
    experts, weights = route(cfg, lp["router"], x)
    paths = {"gather": _gathered, "ragged": _ragged}
    if path == "auto":  # chosen where the step is lowered: a TPU program exported on a CPU host is TPU's
        out = jax.lax.platform_dependent(
            lp, x, experts, weights, cpu=partial(_gathered, cfg), default=partial(_ragged, cfg)
        )
    else:
        out = paths[path](cfg, lp, x, experts, weights)
    if cfg.shared_expert_size:
        shared = linear(_act(cfg, linear(x, lp["shared_gate_up"]), x.dtype), lp["shared_down"]).astype(
            x.dtype
        )
        gate = jax.nn.sigmoid(linear(x, lp["shared_gate"]).astype(x.dtype))
        out = out + gate * shared
    return out
