"""Worker configuration: frozen dataclasses read from flags or ``LORASERVE_WORKER_*`` environment variables."""

from __future__ import annotations

from dataclasses import dataclass, fields

from loraserve.common.config import InferenceSecurityConfig, config_from_env

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """Shapes fixed at start-up: nothing the engine compiles depends on anything else."""

    max_batch_size: int = 8  # decode rows per step
    max_seq_len: int = 256  # context length (prompt + new tokens)
    max_loras: int = 4  # adapter slots on the device
    max_lora_rank: int = 16  # largest rank a slot holds
    max_cpu_loras: int = 16  # adapters kept in host memory after eviction
    max_mix: int = 4  # adapters one request's weighted mix may name (adapters.mixes)
    max_waiting: int = 256  # queued requests before RESOURCE_EXHAUSTED
    prefill_per_step: int = 2  # prompts admitted (and prefilled together, packed) between two decode steps
    max_prefill_tokens: int = 4096  # tokens one packed prefill computes at most (a longer prompt goes alone)
    # chunked prefill: prompt tokens computed per step at most, a decode step between two chunks (0 = off)
    prefill_chunk: int = 0
    min_prefill_bucket: int = 16
    default_max_tokens: int = 16
    # auto | cpu | xla (= xla-grouped) | xla-grouped | xla-onehot | pallas | reference (kernels.resolve_backend)
    kernel_backend: str = "auto"
    dtype: str = "float32"
    lora_dtype: str = ""  # slot pools: float32 | bfloat16; empty = dtype
    tensor_parallel_size: int = 1  # devices one model is split over (Megatron layout; worker.sharding)
    # decode attention over the paged cache: auto (pallas on a TPU, else xla) | xla | pallas (kernels.attention)
    attention_backend: str = "auto"
    # the base model's bf16 projections of up to kernels.linear.KERNEL_MAX_ROWS rows: auto (the C++ kernel on
    # a CPU with AVX-512 BF16) | xla | cpu (kernels.linear); tensor-parallel programs always use xla
    linear_backend: str = "auto"
    # paged KV cache (worker.kv_cache): one pool of pages per layer, a page table per row
    kv_page_size: int = 16  # tokens per page
    kv_pages: int = 0  # pages in the pool (page 0 is the reserved null page); 0 = from kv_cache_bytes
    kv_cache_bytes: int = 0  # pool size in bytes when kv_pages is 0; both 0 = max_batch_size full contexts
    enable_prefix_caching: bool = True  # reuse full pages computed under the same adapter and tokens

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
        if self.linear_backend not in LINEAR_BACKENDS:
            names = ", ".join(LINEAR_BACKENDS)
            raise ValueError(f"linear_backend must be one of {names}, got {self.linear_backend!r}")
        if self.linear_backend == "cpu" and self.tensor_parallel_size > 1:
            raise ValueError(
                "linear_backend cpu runs on one device; with tensor_parallel_size > 1 use auto or xla"
                " (a sharded program's projections are XLA's)"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.lora_dtype not in ("", *DTYPES):
            raise ValueError(f"lora_dtype must be float32 or bfloat16 (or empty), got {self.lora_dtype!r}")
        names = ("max_batch_size", "max_seq_len", "max_loras", "max_lora_rank", "prefill_per_step")
        names = (*names, "max_prefill_tokens")
        for name in (*names, "tensor_parallel_size", "max_mix"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_seq_len < 2:
            raise ValueError("max_seq_len must be >= 2")
        if self.prefill_chunk < 0:
            raise ValueError("prefill_chunk must be >= 0 (0 = whole prompts)")
        if self.kv_page_size < 1 or self.kv_pages < 0 or self.kv_cache_bytes < 0:
            raise ValueError("kv_page_size must be >= 1, kv_pages and kv_cache_bytes >= 0")
        if self.kv_pages and self.kv_pages < self.pages_per_row + 1:
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
    def pool_dtype(self) -> str:
        return self.lora_dtype or self.dtype

    @property
    def pages_per_row(self) -> int:
        """Page-table entries of one sequence: ``ceil(max_seq_len / kv_page_size)``."""
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


ENV_PREFIX = "LORASERVE_WORKER_"


@dataclass(frozen=True)
class WorkerConfig(InferenceSecurityConfig, EngineConfig):
    """Everything ``loraserve worker`` needs; every field maps to ``LORASERVE_WORKER_<FIELD>``.

    The engine's fields come from ``EngineConfig`` (validated the same way), the token and TLS fields from
    ``InferenceSecurityConfig``; only what the worker process itself needs is declared here.
    """

    model: str = ""  # checkpoint folder or fsspec URL
    model_id: str = ""  # name reported to the registry; defaults to the model path
    host: str = "127.0.0.1"
    port: int = 50061
    adapter_dir: str = ""  # optional root of PEFT folders served by name
    registry: str = ""  # host:port of the registry; adapters then come from it and the worker registers
    advertise_address: str = ""  # host:port others use to reach this worker (default: host:bound port)
    cache_dir: str = ""  # local disk cache of adapter blobs, keyed by sha256
    metrics_port: int = 0  # Prometheus /metrics port (0 = off)
    http_port: int = 0  # OpenAI-compatible HTTP API (+ /metrics, /health) on host:http_port (0 = off)
    metrics_top_adapters: int = 20  # adapters with per-adapter metric series of their own; the rest: "other"
    registry_token: str = ""  # token this worker presents to the registry
    registry_tls_ca: str = ""  # PEM CA of the registry's certificate (TLS to the registry)
    compilation_cache_dir: str = ""  # JAX persistent compilation cache: restarts warm up from disk

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> WorkerConfig:
        return config_from_env(cls, ENV_PREFIX, env, overrides)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})
