"""The JAX runner: parameters, paged KV cache and slot pools on the device, jitted prefill/decode with donation.

The engine's one module that runs the model's steps (``models.decoder``) and writes slots (``SlotPools``,
``slot_arrays``); the planner's ``--verify`` lowers the same steps. Prompts are padded to bucketed lengths;
decode gathers a bucketed width of page-table columns (``decode_page_buckets``) and picks one of the LoRA
backend's ``warmup_plans`` variants, so after ``warmup`` nothing compiles while serving.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loraserve import kernels
from loraserve.adapters.peft import LoraWeights
from loraserve.common.errors import FailedPrecondition, LoraserveError
from loraserve.engine.config import EngineConfig
from loraserve.engine.named_arrays import fields_of, slot_values_arrays
from loraserve.engine.request import SamplingRow, TokenLogprobs
from loraserve.engine.runner import PrefillInput, StepOutput
from loraserve.kernels.attention import DecodeAttention, resolve_attention
from loraserve.kernels.backends import LoraBackend
from loraserve.kernels.linear import resolve_backend as resolve_linear
from loraserve.kernels.linear import traced_with
from loraserve.kernels.sharded import ShardedBackend
from loraserve.models import decoder, sharding, speculative
from loraserve.models.checkpoint import Checkpoint, read_params
from loraserve.models.config import ModelConfig
from loraserve.models.lora.pools import (
    SlotPools,
    SlotValues,
    base_weights,
    check_slot_values,
    is_scaled,
    slot_arrays,
)
from loraserve.models.sampling import (
    BIAS_ENTRIES,
    HISTORY_CHUNK,
    NO_ROW,
    RowHistory,
    Sampled,
    SamplingArrays,
    sample,
    seed_row,
)
from loraserve.models.sizes import MAX_EOS_IDS
from loraserve.models.step import (
    DONATED,
    Array,
    Cache,
    DecodeBatch,
    DeviceState,
    LoraPools,
    Params,
    PrefillBatch,
)

log = logging.getLogger("loraserve.engine.runner")


def prefill_step(
    cfg: ModelConfig,
    backend: LoraBackend,
    *,
    params: Params,
    pools: LoraPools,
    cache: Cache,
    rope: Array,
    batch: PrefillBatch,
    sampling: SamplingArrays | None = None,
    history: RowHistory | None = None,
):
    """Prefill ``batch`` and sample each sequence's next token: ``(Sampled [G], new cache)``; without
    ``sampling``, ``(logits [G, V], new cache)``. A batch with ``targets`` also scores its prompts
    (``Sampled.prompt``; without ``sampling``: ``((logits, PromptScores), new cache)``)."""
    state = DeviceState(params, pools, cache, rope)
    if batch.targets is None:
        logits, cache = decoder.prefill_packed(cfg, backend, state, batch)
        return (logits if sampling is None else sample(logits, sampling, history)), cache
    logits, scores, cache = decoder.prefill_scored(cfg, backend, state, batch)
    if sampling is None:
        return (logits, scores), cache
    return sample(logits, sampling, history)._replace(prompt=scores), cache


def decode_step(
    cfg: ModelConfig,
    backend: LoraBackend,
    attention: Any,
    *,
    params: Params,
    pools: LoraPools,
    cache: Cache,
    rope: Array,
    batch: DecodeBatch,
    sampling: SamplingArrays | None = None,
    history: RowHistory | None = None,
):
    """One decode step of every row and its sampled token: ``(Sampled [B], new cache)``; without
    ``sampling``, ``(logits [B, V], new cache)``."""
    state = DeviceState(params, pools, cache, rope)
    logits, cache = decoder.decode(cfg, backend, state, batch, attention)
    return (logits if sampling is None else sample(logits, sampling, history)), cache


def verify_step(
    cfg: ModelConfig,
    backend: LoraBackend,
    *,
    params: Params,
    pools: LoraPools,
    cache: Cache,
    rope: Array,
    batch: PrefillBatch,
    drafts: Array,
    draft_lens: Array,
    sampling: SamplingArrays,
    history: RowHistory | None = None,
):
    """Speculative decoding's verify step (docs/speculative.md): every row's last token and drafts after its
    cached context (``batch``: G rows of k + 1 tokens, ``lengths`` 0 for idle rows), the drafts each row keeps
    and the token after them: ``(Verified, new cache)``. ``history`` is not read (rows with logits controls
    do not speculate): the parameter only matches the other steps' donated names."""
    del history
    state = DeviceState(params, pools, cache, rope)
    logits, cache = decoder.verify_logits(cfg, backend, state, batch)
    s = sampling
    verified = speculative.verify(
        logits, drafts, draft_lens, s.temperature, s.top_k, s.top_p, s.seed_lo, s.seed_hi, s.step
    )
    return verified, cache


class Steps(NamedTuple):
    """The compiled steps of one model: call with keyword arguments only (``DeviceState.fields()``,
    ``batch=``, ``sampling=``); each returns ``(Sampled, new cache)`` (without ``sampling``: the logits),
    the old cache and history donated (the new history is ``Sampled.history``). ``seed``: the compiled
    ``models.sampling.seed_row``, the history donated."""

    prefill: Any
    decode: Any
    seed: Any
    verify: Any


def jit_steps(
    cfg: ModelConfig,
    backend: LoraBackend,
    attention: Any = "xla",
    linear: str = "auto",
    out_shardings: Any = None,
    precision: str = "default",
) -> Steps:
    """Jit :func:`prefill_step` and :func:`decode_step` for ``cfg`` on ``backend``, each traced under the
    ``linear`` backend of the base projections (``kernels.linear``), the KV cache and history donated by
    name. ``out_shardings`` (tensor parallelism): ``(sampled, cache)`` shardings, pinned so the donated
    cache keeps one layout. ``precision``: the ``jax.default_matmul_precision`` the steps are traced under
    (``EngineConfig.traced_matmul_precision``; what a TPU does with float32 products, :func:`traced_at`).

    Memoized per process (the last :data:`STEPS_KEPT` distinct arguments, compared by value): runners of one
    model on one backend (a benchmark's peer engines, a runner rebuilt in place, a test suite) share the
    jitted functions, so each input shape is traced, lowered and compiled once per process. The weights are
    arguments of the steps, not constants, so two checkpoints of one architecture share them too."""
    key = _frozen((cfg, backend, attention, linear, out_shardings, precision))
    with _steps_lock:
        steps = _steps_memo.get(key)
        if steps is not None:
            _steps_memo.move_to_end(key)
            return steps
    jit = partial(jax.jit, donate_argnames=DONATED)
    if out_shardings is not None:
        jit = partial(jit, out_shardings=out_shardings)
    seed_shardings = None if out_shardings is None else out_shardings[0]
    steps = Steps(
        jit(traced_at(precision, traced_with(linear, partial(prefill_step, cfg, backend)))),
        jit(traced_at(precision, traced_with(linear, partial(decode_step, cfg, backend, attention)))),
        jax.jit(seed_row, donate_argnames="history", out_shardings=seed_shardings),
        jit(traced_at(precision, traced_with(linear, partial(verify_step, cfg, backend)))),
    )
    with _steps_lock:
        steps = _steps_memo.setdefault(key, steps)  # a racing thread's steps win: one set per key
        while len(_steps_memo) > STEPS_KEPT:
            _steps_memo.popitem(last=False)
    return steps


def traced_at(precision: str, fn: Callable) -> Callable:
    """``fn`` traced under ``jax.default_matmul_precision(precision)``: every float32 product it traces
    without a precision of its own takes that one (a TPU multiplies float32 in one bfloat16 pass at
    ``default``, in ~6 at ``highest``; a CPU exactly at every setting). ``default`` adds nothing."""
    if precision == "default":
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.default_matmul_precision(precision):
            return fn(*args, **kwargs)

    return wrapped


STEPS_KEPT = 16  # jit_steps' memo: distinct (model, backend, attention, linear, shardings) kept per process
_steps_memo: OrderedDict[Hashable, Steps] = OrderedDict()
_steps_lock = threading.Lock()


def _frozen(value: Any) -> Hashable:
    """``value`` as a hashable key equal for equal values: dataclasses by type and fields, dicts by sorted
    items, lists and tuples by items; anything else (strings, numbers, meshes, shardings) as it is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple(_frozen(getattr(value, f.name)) for f in dataclasses.fields(value))
        return (type(value), fields)
    if isinstance(value, dict):
        return (dict, tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_frozen(v) for v in value))
    hash(value)  # TypeError now, not at the memo's lookup
    return value


def _sampling_arrays(
    rows: list[SamplingRow | None], history_rows: list[int] | None = None, vocab: int = 0
) -> SamplingArrays:
    """The batch's rows as device inputs; ``history_rows[i]``: the RowHistory row row ``i``'s controls
    read (NO_ROW, or no list: none, also for a row that has controls but whose sample is dropped); token
    masks over ``vocab`` tokens."""
    arrays = SamplingArrays.empty(len(rows), vocab)
    history_rows = history_rows or [NO_ROW] * len(rows)
    for i, r in enumerate(rows):
        if r is None:
            continue
        arrays.temperature[i], arrays.top_k[i], arrays.top_p[i] = r.temperature, r.top_k, r.top_p
        arrays.seed_lo[i], arrays.seed_hi[i] = r.seed & 0xFFFFFFFF, r.seed >> 32
        arrays.step[i], arrays.logprobs[i] = r.step, r.logprobs
        if r.controlled and history_rows[i] != NO_ROW:
            arrays.presence[i], arrays.frequency[i] = r.presence, r.frequency
            arrays.repetition[i], arrays.history_row[i] = r.repetition, history_rows[i]
        if r.mask is not None:
            arrays.masked[i], arrays.mask[i] = True, r.mask
    return arrays


def _to_host(out: Sampled, logprobs: bool, targets: np.ndarray | None = None) -> StepOutput:
    """The device's draw on the host; the logprob arrays are copied only when some row asked, the prompt
    scores only when some target (``targets`` [G, L]) is set."""
    prompt = None
    if targets is not None and out.prompt is not None and (targets >= 0).any():
        lp, ids, top = (np.asarray(a) for a in out.prompt)
        prompt = tuple(
            tuple(
                TokenLogprobs(float(lp[g, i]), tuple(ids[g, i].tolist()), tuple(top[g, i].tolist()))
                for i in np.flatnonzero(row >= 0)
            )
            or None
            for g, row in enumerate(targets)
        )
    if not logprobs:
        return StepOutput(np.asarray(out.tokens), prompt=prompt)
    return StepOutput(
        np.asarray(out.tokens),
        np.asarray(out.logprob),
        np.asarray(out.top_ids),
        np.asarray(out.top_logprobs),
        prompt,
    )


class _Dispatched(NamedTuple):
    """A decode step dispatched to the device (``JaxRunner.decode_start``): its draw, still there."""

    out: Sampled
    logprobs: bool  # some row asked: decode_finish copies the logprob arrays too


class JaxRunner:
    """The real device side (``engine.runner.Runner``) over one checkpoint and ``max_loras`` slot pools.

    With ``tensor_parallel_size`` N > 1 the params, KV cache and slot pools live on a 1-D ``model`` mesh of
    N devices (``models.sharding``), the LoRA backend runs per shard (``kernels.sharded``) and the jitted
    steps pin their outputs' shardings, so donated buffers keep one layout and nothing recompiles.
    """

    def __init__(self, checkpoint: Checkpoint, config: EngineConfig, channel: Any = None) -> None:
        # multi-host (engine.multihost): the leader's channel to the other processes, which replay every
        # device call in the same order (multihost.follow); None on one host and on a follower
        self.channel, self._replaying = None, True
        self.config, self.checkpoint_config = config, checkpoint.config
        backend = kernels.resolve_backend(config.kernel_backend)
        if len(checkpoint.config.eos_token_ids) > MAX_EOS_IDS:  # min_tokens bans them from a bias table
            raise ValueError(
                f"the model has {len(checkpoint.config.eos_token_ids)} EOS ids; at most {MAX_EOS_IDS}"
            )
        n = config.tensor_parallel_size
        self.mesh = None
        self.multiprocess = jax.process_count() > 1  # every process runs this constructor (engine.multihost)
        if n == 1 and not self.multiprocess:  # host params (load_checkpoint(place=False)) go to the device
            self.model_config, self.backend = checkpoint.config, backend
            self.params = read_params(checkpoint)  # one tensor at a time onto the device
            out_shardings = None
        else:
            sharding.check_tensor_parallel(checkpoint.config, n, len(jax.devices()))
            if self.multiprocess and n != jax.device_count():
                raise FailedPrecondition(
                    f"tensor_parallel_size {n} must span all {jax.device_count()} devices of the"
                    f" {jax.process_count()} processes ({jax.local_device_count()} each)"
                )
            self.mesh = sharding.make_mesh(n)
            self.model_config = sharding.tp_model_config(checkpoint.config, n)
            self.params = sharding.shard_params(
                checkpoint.config, checkpoint.params, self.mesh, checkpoint.dtype
            )
            self.backend = ShardedBackend(backend, self.mesh)
            cache = NamedSharding(self.mesh, sharding.CACHE_SPEC)
            self._cache_shardings = [(cache, cache)] * self.model_config.num_layers
            out_shardings = (NamedSharding(self.mesh, P()), self._cache_shardings)
        if checkpoint.files is not None and checkpoint.files.bytes_read:
            log.info(
                "checkpoint %s: read %.2f MiB of its %.2f MiB (%.0f%%; process %d of %d)",
                checkpoint.source,
                checkpoint.files.bytes_read / 2**20,
                checkpoint.files.total_bytes / 2**20,
                100 * checkpoint.files.bytes_read / max(1, checkpoint.files.total_bytes),
                jax.process_index(),
                jax.process_count(),
            )
        # decode attention over the pages: the TPU kernel runs per device of the mesh (kernels.attention)
        impl = resolve_attention(config.attention_backend, checkpoint.config.head_dim, config.kv_page_size)
        self.attention = DecodeAttention(impl, self.mesh)
        log.info(
            "multi-LoRA kernels: %s (%s), slot pools %s, tensor parallel %d, decode attention %s (%s),"
            " base projections %s (%s)",
            self.backend,
            config.kernel_backend,
            config.pool_dtype,
            n,
            self.attention.impl,
            config.attention_backend,
            resolve_linear(config.traced_linear_backend),
            config.linear_backend,
        )
        self.rope = jnp.asarray(self.model_config.inv_freq(), jnp.float32)
        self.vocab_size = checkpoint.config.vocab_size  # token masks (structured outputs) cover it
        self.buckets = config.prefill_buckets()
        self.prefill_shapes = config.prefill_shapes()
        self.key_block = decoder.key_block_pages(config.kv_page_size, config.pages_per_row)
        self.page_buckets = config.decode_page_buckets()
        self.page_size = config.kv_page_size
        page_bytes = decoder.kv_page_bytes(checkpoint.config, self.page_size, config.dtype)
        self.num_pages = config.num_kv_pages(page_bytes)
        log.info(
            "paged KV cache: %d pages of %d tokens (%.1f MiB), context %d",
            self.num_pages,
            self.page_size,
            self.num_pages * page_bytes / 2**20,
            config.max_seq_len,
        )
        # the base projections of both steps run on config.traced_linear_backend (kernels.linear)
        self._steps = jit_steps(
            self.model_config,
            self.backend,
            self.attention,
            config.traced_linear_backend,
            out_shardings,
            config.traced_matmul_precision,
        )
        self.init_state()
        self.channel, self._replaying = channel, False

    def _send_to_followers(self, op: str, arrays: dict[str, np.ndarray] | None = None) -> None:
        """A multi-host leader sends each device call to the other processes before making it
        (``engine.multihost``); a follower replaying it, and warm-up's inner calls, send nothing."""
        if self.channel is not None and not self._replaying:
            self.channel.broadcast(op, arrays or {})

    def init_state(self) -> None:
        self._send_to_followers("init")
        cfg, config = self.model_config, self.config
        shardings = None if self.mesh is None else sharding.pool_shardings(cfg, self.backend)
        self.pools = SlotPools(
            cfg,
            config.max_loras,
            config.max_lora_rank,
            jnp.dtype(config.pool_dtype),
            self.backend,
            shardings,
            base=base_weights(self.params),  # DoRA scales are computed from them (prepare)
        )
        self.cache = decoder.init_cache(cfg, self.num_pages, self.page_size, jnp.dtype(config.dtype))
        self.history = RowHistory.zeros(config.max_batch_size, cfg.vocab_size)
        if self.mesh is not None:
            self.cache = jax.device_put(self.cache, self._cache_shardings)
            self.history = jax.device_put(self.history, NamedSharding(self.mesh, P()))

    def warmup(self) -> None:
        """Compile every prefill bucket and every (page width, LoRA plan) decode variant; the null page
        takes every write, so the cache holds nothing afterwards. A multi-host leader's followers run
        the same warm-up when told to (deterministic: the same programs in the same order)."""
        self._send_to_followers("warmup")
        replaying, self._replaying = self._replaying, True
        try:
            self._warmup()
        finally:
            self._replaying = replaying

    def _warmup(self) -> None:
        for g, t in self.prefill_shapes:
            null = PrefillInput([0], 0, 0, np.zeros(self.config.pages_per_row, np.int32), SamplingRow())
            self._prefill_call([null] * g, g, t)
        b = self.config.max_batch_size
        zeros = np.zeros(b, np.int32)
        # one decode compilation per page width times plan variant of the LoRA backend (backend.plan picks
        # one per step)
        for width in self.page_buckets:
            tables = np.zeros((b, width), np.int32)
            for plan in self.backend.warmup_plans(b, self.config.max_loras):
                out, self.cache = self._steps.decode(
                    **self.state().fields(),
                    batch=DecodeBatch(self._decode_tokens(zeros), zeros, tables, plan),
                    sampling=SamplingArrays.empty(b, self.vocab_size),
                )
                self.history = out.history
        if self.config.speculative != "off":  # the verify step's one shape: every row, k + 1 tokens
            k = self.config.num_speculative_tokens
            self.verify(
                zeros, zeros, np.full(b, -1, np.int32), np.zeros((b, self.config.pages_per_row), np.int32),
                np.zeros((b, k), np.int32), zeros, [None] * b,
            )  # fmt: skip
        self.seed_history(0, [0], [], [])
        self.pools.zero(0)
        jax.block_until_ready((out.tokens, self.history))

    def state(self) -> DeviceState:
        """What the next step reads: the params, the slot pools as the latest write left them, the cache."""
        return DeviceState(self.params, self.pools.pools, self.cache, self.rope, self.history)

    def prepare(self, weights: LoraWeights) -> SlotValues:
        values = slot_arrays(self.checkpoint_config, weights, self.config.max_lora_rank)
        values = sharding.expand_slot_values(self.checkpoint_config, values, self.config.tensor_parallel_size)
        if not self.multiprocess:  # DoRA's norms here, on the loader thread, not between steps; across
            # processes every device call keeps one order, so write_slot computes them (all processes)
            values = self.pools.with_scales(values)
        check_slot_values(values)  # what the slot will hold, scales and mix weights folded in
        return values

    def write_slot(self, index: int, values: SlotValues) -> None:
        """Write one slot. Across processes DoRA's scales are computed here (``prepare`` could not) and
        checked as ``prepare`` checks them on one host: every process computes the same replicated scales
        and so makes the same decision; refused values leave the slot empty (zeros) on every process and
        raise INVALID_ARGUMENT naming the layer and pool (the residency fails the load)."""
        if self.channel is not None:
            self._send_to_followers(
                "write", {"index": np.asarray(index, np.int32), **slot_values_arrays(values)}
            )
        if self.multiprocess and not is_scaled(values):
            values = self.pools.with_scales(values)
            try:
                check_slot_values(values)
            except LoraserveError:
                self.pools.zero(index)
                raise
        self.pools.write(index, values)

    def zero_slot(self, index: int) -> None:
        self._send_to_followers("zero", {"index": np.asarray(index, np.int32)})
        self.pools.zero(index)

    def seed_history(
        self, row: int, prompt: list[int], generated: list[int], bias: list[tuple[int, float, int]]
    ) -> None:
        ids = np.full(BIAS_ENTRIES, -1, np.int32)
        values, until = np.zeros(BIAS_ENTRIES, np.float32), np.zeros(BIAS_ENTRIES, np.int32)
        for e, (token, value, steps) in enumerate(bias):
            ids[e], values[e], until[e] = token, value, steps
        tokens = np.asarray(prompt + generated, np.int32)
        counted = np.arange(len(tokens)) >= len(prompt)
        for k in range(0, max(len(tokens), 1), HISTORY_CHUNK):  # the first call resets the row
            chunk = np.full(HISTORY_CHUNK, -1, np.int32)
            part = tokens[k : k + HISTORY_CHUNK]
            chunk[: len(part)] = part
            flags = np.zeros(HISTORY_CHUNK, np.bool_)
            flags[: len(part)] = counted[k : k + HISTORY_CHUNK]
            self.seed_arrays(
                row=np.asarray(row, np.int32),
                tokens=chunk,
                generated=flags,
                bias_ids=ids,
                bias_values=values,
                bias_until=until,
                reset=np.asarray(k == 0),
            )

    def seed_arrays(self, **arrays: np.ndarray) -> None:
        """One compiled ``seed_row`` call (``models.sampling.seed_row``'s keyword arrays)."""
        self._send_to_followers("seed", arrays)
        self.history = self._steps.seed(history=self.history, **arrays)

    def prefill(self, batch: list[PrefillInput]) -> StepOutput:
        """Pack ``batch`` into the fewest calls of the compiled (prompts, tokens) shapes, in order."""
        parts: list[StepOutput] = []
        i = 0
        while i < len(batch):
            n, g, t = self._pack(batch[i:])
            parts.append(self._prefill_call(batch[i : i + n], g, t).head(n))
            i += n
        return parts[0] if len(parts) == 1 else StepOutput.concat(parts)

    def _pack(self, rest: list[PrefillInput]) -> tuple[int, int, int]:
        """How many of ``rest`` the next call takes and the compiled shape ``(prompts, tokens)`` it runs
        in: the most leading items that fit one shape (one item always fits)."""
        best: tuple[int, int, int] | None = None
        longest = 0
        for n, item in enumerate(rest, 1):
            longest = max(longest, len(item.tokens))
            t = self._bucket(longest)
            g = next((g for g, tt in self.prefill_shapes if g >= n and tt == t), None)
            if g is None:
                break
            best = (n, g, t)
        assert best is not None, "every prompt bucket has a one-prompt shape"
        return best

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _prefill_call(self, items: list[PrefillInput], g: int, t: int) -> StepOutput:
        """One compiled call of shape ``(g, t)`` for ``items`` (at most g; the rest are empty segments);
        returns g rows, the first ``len(items)`` of them real."""
        tokens = np.zeros((g, t), np.int32)
        lengths, starts = np.zeros(g, np.int32), np.zeros(g, np.int32)
        slots = np.full(g, -1, np.int32)
        tables = np.zeros((g, self.config.pages_per_row), np.int32)
        targets = np.full((g, t), -1, np.int32)
        rows: list[SamplingRow | None] = [None] * g
        history_rows = [NO_ROW] * g
        for k, item in enumerate(items):
            tokens[k, : len(item.tokens)] = item.tokens
            lengths[k], starts[k], slots[k] = len(item.tokens), item.start, item.slot
            tables[k] = item.page_table
            rows[k], history_rows[k] = item.sampling, item.row
            if item.targets is not None:
                targets[k, : len(item.targets)] = item.targets
        context = int(np.max(starts + lengths))
        blocks = np.int32(max(1, -(-context // (self.key_block * self.page_size))))
        out = self.prefill_arrays(
            PrefillBatch(tokens, lengths, starts, slots, tables, blocks, targets),
            _sampling_arrays(rows, history_rows, self.vocab_size),
        )
        return _to_host(out, any(item.sampling.logprobs for item in items), targets)

    def prefill_arrays(self, batch: PrefillBatch, sampling: SamplingArrays) -> Sampled:
        """One compiled prefill call of host arrays (the device's draw stays on the device)."""
        if self.channel is not None:
            self._send_to_followers(
                "prefill", {**fields_of("batch", batch), **fields_of("sampling", sampling)}
            )
        out, self.cache = self._steps.prefill(**self.state().fields(), batch=batch, sampling=sampling)
        self.history = out.history
        return out

    def decode(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        sampling: list[SamplingRow | None],
    ) -> StepOutput:
        return self.decode_finish(self.decode_start(tokens, positions, slots, page_tables, sampling))

    def verify(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        drafts: np.ndarray,
        draft_lens: np.ndarray,
        sampling: list[SamplingRow | None],
    ) -> tuple[np.ndarray, np.ndarray]:
        if self.channel is not None:
            raise RuntimeError(
                "speculative decoding runs in one process (a multi-host slice decodes plainly)"
            )
        b, k = drafts.shape
        batch_tokens = np.zeros((b, k + 1), np.int32)
        batch_tokens[:, 0] = tokens
        batch_tokens[:, 1:] = drafts
        live = np.array([r is not None for r in sampling])
        lengths = np.where(live, 1 + np.asarray(draft_lens, np.int32), 0).astype(np.int32)
        context = int(np.max(np.asarray(positions) + lengths))
        blocks = np.int32(max(1, -(-context // (self.key_block * self.page_size))))
        batch = PrefillBatch(
            batch_tokens,
            lengths,
            np.asarray(positions, np.int32),
            np.asarray(slots, np.int32),
            np.array(page_tables, np.int32),
            blocks,
        )
        rows = [NO_ROW] * b  # no logits controls: their history is not read
        out, self.cache = self._steps.verify(
            **{k: v for k, v in self.state().fields().items() if k != "history"},
            batch=batch,
            drafts=np.asarray(drafts, np.int32),
            draft_lens=np.where(live, np.asarray(draft_lens, np.int32), 0).astype(np.int32),
            sampling=_sampling_arrays(sampling, rows, self.vocab_size),
        )
        return np.asarray(out.accepted), np.asarray(out.tokens)

    @property
    def chains(self) -> bool:
        """Async decode (``Runner.decode_start``'s ``follow``) in one process; across processes every call
        sends its host arrays to the followers (engine.multihost), so each step reads its tokens first."""
        return self.channel is None

    def decode_start(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        sampling: list[SamplingRow | None],
        follow: _Dispatched | None = None,
    ) -> _Dispatched:
        needed = int(np.max(positions)) // self.page_size + 1  # pages of the longest row
        width = next(w for w in self.page_buckets if w >= needed)
        out = self.decode_arrays(
            self._decode_tokens(np.asarray(tokens, np.int32)) if follow is None else follow.out.tokens,
            np.asarray(positions, np.int32),
            np.asarray(slots, np.int32),
            np.array(page_tables[:, :width], np.int32),  # a copy: the caller rewrites its tables next step
            _sampling_arrays(sampling, list(range(len(sampling))), self.vocab_size),
        )
        return _Dispatched(out, any(r is not None and r.logprobs for r in sampling))

    def decode_finish(self, handle: _Dispatched) -> StepOutput:
        return _to_host(handle.out, handle.logprobs)

    def _decode_tokens(self, tokens: np.ndarray) -> Any:
        """A decode step's tokens as the step before's draw lies (async decode passes that on as is): on a
        mesh, replicated over it (the steps' pinned output sharding), so both are one compiled signature;
        across processes (no async decode there) host arrays, as every process replays them."""
        if self.mesh is None or self.multiprocess:
            return tokens
        return jax.device_put(tokens, NamedSharding(self.mesh, P()))

    def decode_arrays(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        sampling: SamplingArrays,
    ) -> Sampled:
        """One compiled decode call of host arrays, ``page_tables`` already cut to a compiled width."""
        if self.channel is not None:
            arrays = {"tokens": tokens, "positions": positions, "slots": slots, "page_tables": page_tables}
            self._send_to_followers("decode", {**arrays, **fields_of("sampling", sampling)})
        batch = DecodeBatch(tokens, positions, page_tables, self.backend.plan(slots, self.config.max_loras))
        out, self.cache = self._steps.decode(**self.state().fields(), batch=batch, sampling=sampling)
        self.history = out.history
        return out
