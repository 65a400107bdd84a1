"""The engine's configuration: ``EngineConfig``, frozen, every option declared once with its help text and
``--help`` group (common.config.opt; ``worker.config.WorkerConfig`` reads them from flags or
``LORASERVE_WORKER_*`` environment variables). Two of its fields
default to ``auto`` for ``loraserve worker`` (``WorkerConfig``) and resolve against the checkpoint's
``config.json`` in one place, :func:`resolve_engine_config`:

- ``dtype auto``: the checkpoint's ``torch_dtype`` (``dtype`` in newer transformers): bfloat16 for a bfloat16
  or float16 checkpoint (float16 is served as bfloat16: the same bytes, a wider range; ask for float32 to keep
  every float16 bit), float32 for float32, another dtype or none;
- ``max_seq_len auto``: the model's context (``max_position_embeddings``), at most what the KV budget holds
  (``kv_pages``, or ``kv_cache_bytes`` at the resolved dtype: one full context plus the null page) or, with
  no budget (the pool is then ``max_batch_size`` full contexts), at most ``AUTO_MAX_SEQ_LEN`` tokens.

``EngineConfig`` built in code keeps explicit defaults (256 tokens, float32); an ``EngineConfig`` still
holding ``auto`` cannot run an engine (``check_resolved``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from loraserve.common.config import (
    AUTO,
    ConfigError,
    opt,
)
from loraserve.common.limits import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
MATMUL_PRECISIONS = (AUTO, "default", "high", "highest")  # jax.default_matmul_precision's names, and auto
# the choices of kernel_backend, attention_backend and linear_backend below are the values of
# kernels.KERNEL_BACKENDS, kernels.attention.ATTENTION_BACKENDS and kernels.linear.LINEAR_BACKENDS, spelled
# out so that `loraserve --help` imports no JAX (tests/worker/test_config.py keeps them equal)


# max_seq_len auto with no KV budget (--kv-pages, --kv-cache-bytes): the pool is then max_batch_size full
# contexts, so the context is capped here rather than at a long-context model's 128k
AUTO_MAX_SEQ_LEN = 4096

MODEL, CACHE, ADAPTERS, SCHEDULING, KERNELS, SERVING, MULTIHOST = (
    "model",
    "cache",
    "adapters",
    "scheduling",
    "kernels",
    "serving",
    "multi-host",
)


@dataclass(frozen=True)
class EngineConfig:
    """Shapes fixed at start-up: nothing the engine compiles depends on anything else."""

    max_batch_size: int = opt(8, "decode rows per step", SCHEDULING)
    max_seq_len: int | Literal["auto"] = opt(
        256,
        "context length: prompt plus new tokens. auto: the model's max_position_embeddings, at most what the"
        f" KV budget holds (--kv-pages / --kv-cache-bytes), or at most {AUTO_MAX_SEQ_LEN} without a budget; the"
        " worker logs the value it chose",
        MODEL,
    )
    max_loras: int = opt(4, "adapter slots on the device", ADAPTERS)
    max_lora_rank: int = opt(16, "largest adapter rank a slot holds", ADAPTERS)
    max_cpu_loras: int = opt(16, "adapters kept in host memory after eviction", ADAPTERS)
    max_mix: int = opt(
        4,
        "adapters one request's weighted mix may name (adapters.mixes; a mix's summed rank must fit"
        " --max-lora-rank)",
        ADAPTERS,
    )
    fair_slots: bool = opt(
        True,
        "fair sharing of slots: when a loaded adapter finds every slot in use, the slot filled longest ago"
        " stops taking new requests and changes hands once its running ones finish (its new requests wait"
        " their turn), so no adapter's requests wait for ever behind a steady stream for others; off: a"
        " waiting adapter gets a slot only when one is idle",
        ADAPTERS,
    )
    max_waiting: int = opt(256, "queued requests before RESOURCE_EXHAUSTED", SCHEDULING)
    prefill_per_step: int = opt(
        2, "prompts admitted between two decode steps (prefilled together in one packed call)", SCHEDULING
    )
    max_prefill_tokens: int = opt(
        4096,
        "tokens one packed prefill computes at most (prompts x padded length); a longer prompt is prefilled"
        " alone",
        SCHEDULING,
    )
    prefill_chunk: int = opt(
        0,
        "chunked prefill: prompt tokens computed per step at most, with a decode step of the running rows"
        " between two chunks, so a long prompt never stalls them for more than one chunk; 0 = off (a prompt"
        " is prefilled whole in one step)",
        SCHEDULING,
    )
    min_prefill_bucket: int = opt(
        16, "smallest prefill token bucket (buckets double up to --max-seq-len)", SCHEDULING
    )
    async_decode: bool = opt(
        False,
        "dispatch each decode step before reading the previous one's tokens, its inputs taken from that step's"
        " output on the device, so the host's dispatch overlaps the device's work (the bench model's decode at"
        " batch 1: 1.13-1.17x the tokens a second); only while the batch runs unchanged with no structured output,"
        " else one step at a time. A request that ends computes one more token, dropped",
        SCHEDULING,
    )
    speculative: Literal["off", "ngram"] = opt(
        "off",
        "speculative decoding (docs/speculative.md): ngram = each row proposes the tokens that followed the"
        " latest earlier occurrence of its last tokens in its prompt and output, and one verify step keeps"
        " those the model agrees with (greedy: the same tokens as without; sampled: the same distribution);"
        " while a decoding row uses logits controls, structured output or logprobs, steps decode one token;"
        " steps are not chained (--async-decode) while it is on",
        SCHEDULING,
    )
    num_speculative_tokens: int = opt(
        4, "tokens a row proposes for one verify step at most (1-8; --speculative ngram)", SCHEDULING
    )
    default_max_tokens: int = opt(16, "new tokens of a request that sets no max_tokens", SCHEDULING)
    kernel_backend: Literal["auto", "cpu", "pallas", "reference", "xla", "xla-grouped", "xla-onehot"] = opt(
        "auto",
        "multi-LoRA backend (kernels.resolve_backend): auto (cpu on a CPU when its C++ kernels build, pallas on"
        " a TPU, else xla-grouped), cpu, xla (= xla-grouped: rows grouped by slot), xla-grouped, xla-onehot (one-hot over"
        " all slots), pallas or reference",
        KERNELS,
    )
    dtype: Literal["auto", "float32", "bfloat16"] = opt(
        "float32",
        "compute dtype of the base model and the KV cache. auto: the checkpoint's torch_dtype, bfloat16 for"
        " bfloat16 and float16 checkpoints, else float32",
        MODEL,
    )
    lora_dtype: Literal["", "float32", "bfloat16"] = opt(
        "",
        "dtype of the adapter slot pools (empty: --dtype); bfloat16 halves the bytes each decode step reads"
        " for its adapters",
        ADAPTERS,
    )
    tensor_parallel_size: int = opt(
        1,
        "devices one model is split over (tensor parallelism on a 'model' mesh: heads, MLP, vocab, KV heads"
        " and the LoRA slot pools split Megatron-style; models.sharding); must divide the heads and the"
        " intermediate size and be at most the visible devices",
        MODEL,
    )
    attention_backend: Literal["auto", "xla", "pallas", "cpu"] = opt(
        "auto",
        "decode attention over the paged KV cache: auto (on a TPU pallas where it was measured faster: head size"
        " >= 256 with pages >= 16, else xla; on a CPU cpu where the C++ kernels build, else xla), xla (gather each"
        " row's pages, dense attention), cpu (C++ kernel reading the pages in place) or pallas (JAX's TPU"
        " paged-attention kernel; sliding-window layers, and on a TPU head sizes not a multiple of 128, use xla;"
        " interpreted, slowly, off a TPU); kernels.attention",
        KERNELS,
    )
    matmul_precision: Literal["auto", "default", "high", "highest"] = opt(
        "auto",
        "precision of the float32 matrix products of the compiled steps (jax.default_matmul_precision): auto"
        " (highest for --dtype float32, default for bfloat16), default (a TPU multiplies float32 in one"
        " bfloat16 pass: ~3 significant digits), high (three bfloat16 passes) or highest (float32 as a CPU"
        " computes it, ~6 passes on a TPU). CPUs compute float32 exactly at every setting",
        KERNELS,
    )
    linear_backend: Literal["auto", "xla", "cpu"] = opt(
        "auto",
        "the base model's bfloat16 projections of a few rows (decode steps, up to 24 rows, 64 on AMX tiles:"
        " kernels.linear.kernel_max_rows): auto (cpu on a CPU where the"
        " C++ kernels build, else xla), xla or cpu (C++ kernel streaming the weights with prefetch; widens to"
        " float32 on CPUs without bf16 dot products); tensor-parallel workers use xla; xla also keeps a quantized"
        " base (--quantization) on XLA's dot instead of the C++ int8/int4 kernels",
        KERNELS,
    )
    kv_page_size: int = opt(
        16,
        "tokens per KV-cache page (engine.kv_pages: one pool of pages per layer; each sequence holds only the"
        " pages its tokens fill)",
        CACHE,
    )
    kv_pages: int = opt(
        0, "pages in the KV pool, the reserved null page included (0: from --kv-cache-bytes)", CACHE
    )
    kv_cache_bytes: int = opt(
        0, "KV pool size in bytes when --kv-pages is 0 (both 0: --max-batch-size full contexts)", CACHE
    )
    enable_prefix_caching: bool = opt(
        True,
        "reuse the KV pages of a prompt prefix computed under the same adapter content (sha256) or the base"
        " model; never across adapters",
        CACHE,
    )
    kv_events: str = opt(
        "",
        "publish KV-cache events (pages stored and removed, with their adapter's name) in vLLM's format on this"
        " ZMQ endpoint, e.g. tcp://*:5557, for prefix-cache-aware routers (llm-d); empty = off",
        CACHE,
    )
    kv_events_topic: str = opt("", "the ZMQ topic of the KV events (vLLM's default: empty)", CACHE)

    def __post_init__(self) -> None:
        from loraserve.kernels import KERNEL_BACKENDS
        from loraserve.kernels.attention import ATTENTION_BACKENDS
        from loraserve.kernels.linear import LINEAR_BACKENDS

        if self.kernel_backend not in KERNEL_BACKENDS:
            names = ", ".join(n for n in KERNEL_BACKENDS if n != "auto")
            raise ValueError(f"kernel_backend must be auto or one of {names}, got {self.kernel_backend!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            names = ", ".join(ATTENTION_BACKENDS)
            raise ValueError(f"attention_backend must be one of {names}, got {self.attention_backend!r}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            names = ", ".join(MATMUL_PRECISIONS)
            raise ValueError(f"matmul_precision must be one of {names}, got {self.matmul_precision!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            names = ", ".join(LINEAR_BACKENDS)
            raise ValueError(f"linear_backend must be one of {names}, got {self.linear_backend!r}")
        if self.linear_backend == "cpu" and self.tensor_parallel_size > 1:
            raise ValueError(
                "linear_backend cpu runs on one device; with tensor_parallel_size > 1 use auto or xla"
                " (a sharded program's projections are XLA's)"
            )
        if self.dtype not in (AUTO, *DTYPES):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.lora_dtype not in ("", *DTYPES):
            raise ValueError(f"lora_dtype must be float32 or bfloat16 (or empty), got {self.lora_dtype!r}")
        if self.max_seq_len != AUTO and (
            isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int)
        ):
            raise ValueError(f"max_seq_len must be an integer or auto, got {self.max_seq_len!r}")
        names = ("max_batch_size", "max_loras", "max_lora_rank", "prefill_per_step")
        names = (*names, "max_prefill_tokens")
        for name in (*names, "tensor_parallel_size", "max_mix"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_seq_len != AUTO and self.max_seq_len < 2:
            raise ValueError("max_seq_len must be >= 2")
        if self.speculative not in SPECULATIVE_METHODS:
            names = ", ".join(SPECULATIVE_METHODS)
            raise ValueError(f"speculative must be one of {names}, got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be 1 to {MAX_SPECULATIVE_TOKENS}")
        if self.prefill_chunk < 0:
            raise ValueError("prefill_chunk must be >= 0 (0 = whole prompts)")
        if self.kv_page_size < 1 or self.kv_pages < 0 or self.kv_cache_bytes < 0:
            raise ValueError("kv_page_size must be >= 1, kv_pages and kv_cache_bytes >= 0")
        if self.kv_pages and self.max_seq_len != AUTO and self.kv_pages < self.pages_per_row + 1:
            raise ValueError(
                f"kv_pages must hold one full context plus the null page: >= {self.pages_per_row + 1}"
                f" for max_seq_len {self.max_seq_len} at kv_page_size {self.kv_page_size}"
            )

    @property
    def traced_linear_backend(self) -> str:
        """The linear backend the compiled steps are traced with (``kernels.linear.traced_with``):
        ``linear_backend``, but ``xla`` when the model is split over devices."""
        return "xla" if self.tensor_parallel_size > 1 else self.linear_backend

    @property
    def traced_matmul_precision(self) -> str:
        """The matmul precision the compiled steps are traced under: ``matmul_precision``, ``auto`` resolved
        against ``dtype`` (highest for float32: a user who asks for float32 gets float32 products on a TPU
        too; bfloat16 operands take one pass whatever the setting)."""
        if self.matmul_precision != AUTO:
            return self.matmul_precision
        return "highest" if self.dtype == "float32" else "default"

    @property
    def resolved(self) -> bool:
        """Whether no field is ``auto`` any more (``resolve_engine_config``)."""
        return AUTO not in (self.dtype, self.max_seq_len)

    def check_resolved(self) -> None:
        """Refuse a config that still says ``auto``: an engine needs the values."""
        if not self.resolved:
            raise ValueError(
                f"dtype={self.dtype!r}, max_seq_len={self.max_seq_len!r}: resolve auto against the checkpoint"
                " first (engine.config.resolve_engine_config)"
            )

    @property
    def pool_dtype(self) -> str:
        return self.lora_dtype or self.dtype

    @property
    def pages_per_row(self) -> int:
        """Page-table entries of one sequence: ``ceil(max_seq_len / kv_page_size)``."""
        if self.max_seq_len == AUTO:
            self.check_resolved()
        return -(-self.max_seq_len // self.kv_page_size)

    def num_kv_pages(self, bytes_per_page: int) -> int:
        """Pages in the pool, the null page included: ``kv_pages``, else as many as ``kv_cache_bytes``
        holds, else enough for ``max_batch_size`` full contexts (the dense cache's memory)."""
        if self.kv_pages:
            return self.kv_pages
        if self.kv_cache_bytes:
            pages = self.kv_cache_bytes // bytes_per_page
            if pages < self.pages_per_row + 1:
                raise ValueError(
                    f"kv_cache_bytes {self.kv_cache_bytes} holds {pages} pages of {bytes_per_page} bytes;"
                    f" one full context needs {self.pages_per_row + 1}"
                )
            return pages
        return self.max_batch_size * self.pages_per_row + 1

    def decode_page_buckets(self) -> tuple[int, ...]:
        """Page-table widths decode compiles for: powers of two from 256 tokens' worth of pages up to
        ``pages_per_row``. A step gathers only the smallest width that covers its longest row."""
        out, w = [], max(1, 256 // self.kv_page_size)
        while w < self.pages_per_row:
            out.append(w)
            w *= 2
        out.append(self.pages_per_row)
        return tuple(out)

    def prefill_batch_buckets(self) -> tuple[int, ...]:
        """Prompt counts one packed prefill compiles for: powers of two up to ``prefill_per_step`` (at most
        ``max_batch_size``), and that number itself."""
        most = min(self.prefill_per_step, self.max_batch_size)
        out, g = [], 1
        while g < most:
            out.append(g)
            g *= 2
        out.append(most)
        return tuple(out)

    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """(prompts, padded tokens) of every packed prefill variant: one prompt at any bucket, several only
        while ``prompts * tokens <= max_prefill_tokens``."""
        return tuple(
            (g, t)
            for g in self.prefill_batch_buckets()
            for t in self.prefill_buckets()
            if g == 1 or g * t <= self.max_prefill_tokens
        )

    def prefill_buckets(self) -> tuple[int, ...]:
        """Token-count buckets for prefill: powers of two from min_prefill_bucket, capped by max_seq_len."""
        out, b = [], max(1, self.min_prefill_bucket)
        while b < self.max_seq_len:
            out.append(b)
            b *= 2
        out.append(self.max_seq_len)
        return tuple(out)


# ---------------------------------------------------------------- auto, resolved against the checkpoint


def checkpoint_dtype(hf_config: Mapping[str, Any]) -> str:
    """``dtype auto``: the compute dtype for a checkpoint whose ``config.json`` is ``hf_config``.

    Its ``torch_dtype`` (``dtype`` since transformers 4.56): bfloat16 for bfloat16, and for float16 (served
    as bfloat16: the same bytes and a wider range; pass float32 to keep every float16 bit); float32 for
    float32, for anything else and when it says nothing.
    """
    raw = hf_config.get("dtype") or hf_config.get("torch_dtype") or ""
    name = str(raw).removeprefix("torch.").lower()
    return "bfloat16" if name in ("bfloat16", "bf16", "float16", "fp16", "half") else "float32"


def auto_max_seq_len(config: EngineConfig, model: Any, dtype: str) -> tuple[int, str]:
    """``max_seq_len auto``: the model's context (``max_position_embeddings`` of the ``ModelConfig``
    ``model``), capped by the KV budget at ``dtype``, with the reason (for the start-up log)."""
    from loraserve.models.decoder import kv_page_bytes

    context = int(model.max_position_embeddings)
    page = config.kv_page_size
    if config.kv_pages:
        pages, budget = config.kv_pages, f"--kv-pages {config.kv_pages}"
    elif config.kv_cache_bytes:
        page_bytes = kv_page_bytes(model, page, dtype)
        pages = config.kv_cache_bytes // page_bytes
        budget = f"--kv-cache-bytes {config.kv_cache_bytes} ({pages} pages of {page_bytes} bytes)"
    else:
        if context <= AUTO_MAX_SEQ_LEN:
            return context, f"the model's max_position_embeddings {context}"
        return AUTO_MAX_SEQ_LEN, (
            f"the model's max_position_embeddings {context}, capped at {AUTO_MAX_SEQ_LEN} without a KV budget"
            " (--kv-cache-bytes or --kv-pages allow more)"
        )
    most = (pages - 1) * page  # one full context plus the null page
    if most < 2:
        raise ConfigError(
            f"max_seq_len auto: {budget} holds no context of 2 tokens or more (pages of {page} tokens)"
        )
    if context <= most:
        return context, f"the model's max_position_embeddings {context} (fits {budget})"
    return most, f"the model's max_position_embeddings {context}, capped at {most}: what {budget} holds"


def resolve_engine_config(config: EngineConfig, hf_config: Mapping[str, Any]) -> EngineConfig:
    """The one place ``auto`` resolves: ``config``'s engine fields with ``dtype`` and ``max_seq_len`` taken
    from the checkpoint whose parsed ``config.json`` is ``hf_config`` where they say ``auto`` (logged), as
    an ``EngineConfig``. Explicit values pass through unchanged."""
    engine = EngineConfig(**{f.name: getattr(config, f.name) for f in fields(EngineConfig)})
    if engine.dtype == AUTO:
        dtype = checkpoint_dtype(hf_config)
        raw = hf_config.get("dtype") or hf_config.get("torch_dtype")
        log.info("dtype auto: %s (the checkpoint's torch_dtype: %s)", dtype, raw or "not set")
        engine = replace(engine, dtype=dtype)
    if engine.max_seq_len == AUTO:
        from loraserve.models.config import ModelConfig

        length, why = auto_max_seq_len(engine, ModelConfig.from_hf(dict(hf_config)), engine.dtype)
        log.info("max_seq_len auto: %d (%s)", length, why)
        engine = replace(engine, max_seq_len=length)
    return engine
