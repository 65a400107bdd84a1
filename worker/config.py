"""``loraserve worker``'s configuration: ``WorkerConfig``, every field read from a flag or a
``LORASERVE_WORKER_*`` environment variable: the engine's fields (``engine.config.EngineConfig``, ``dtype`` and
``max_seq_len`` defaulting to ``auto`` here), the token and TLS fields, and what the process itself needs
(addresses, the registry, metrics, multi-host).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from loraserve.common.addresses import LISTEN_HELP, check_listen_flags
from loraserve.common.config import AUTO, SECURITY, InferenceSecurityConfig, config_from_env, opt
from loraserve.engine.config import (
    ADAPTERS,
    CACHE,
    KERNELS,
    MODEL,
    MULTIHOST,
    SCHEDULING,
    SERVING,
    EngineConfig,
)

ENV_PREFIX = "LORASERVE_WORKER_"


def _auto(name: str) -> Any:
    """``EngineConfig``'s field ``name`` (its help, its group) with the default ``auto``."""
    return _engine_field(name, AUTO)


def _engine_field(name: str, default: Any) -> Any:
    """``EngineConfig``'s field ``name`` (its help, its group) with another default for the worker process."""
    return field(default=default, metadata=EngineConfig.__dataclass_fields__[name].metadata)


# The worker process's chunked-prefill budget (tokens a step). bench/serve.py, same seeded trace, 100 adapters,
# Zipf 1, 60 s a rate, 2-core AMD EPYC VM (2026-12-05), chunk 0 -> 64: at 0.25 req/s TTFT p50 0.52 -> 0.47 s,
# p99 1.44 -> 1.21 s, inter-token p99 0.24 -> 0.15 s, SLO attainment 0.49 -> 0.89; at 0.5 req/s TTFT p50
# 0.45 -> 0.41 s, p99 0.73 -> 0.82 s, inter-token p99 0.43 -> 0.15 s, SLO attainment 0.35 -> 1.0; the same
# throughput. It does not lose at low load, so it is on; EngineConfig (tests, benchmarks) keeps 0.
WORKER_PREFILL_CHUNK = 64


@dataclass(frozen=True)
class WorkerConfig(InferenceSecurityConfig, EngineConfig):
    """Everything ``loraserve worker`` needs; every field maps to ``LORASERVE_WORKER_<FIELD>``.

    The engine's fields come from ``EngineConfig`` (validated the same way; ``dtype`` and ``max_seq_len``
    default to ``auto`` here, ``prefill_chunk`` to :data:`WORKER_PREFILL_CHUNK`), the token and TLS fields from ``InferenceSecurityConfig``; only what the
    worker process itself needs is declared here.
    """

    GROUPS: ClassVar[dict[str, str]] = {
        MODEL: "the checkpoint, its dtype, its context and the devices it is split over",
        CACHE: "the paged KV cache (engine.kv_pages)",
        ADAPTERS: "adapter slots, the host cache, and where adapters come from",
        SCHEDULING: "batching, admission and prefill",
        KERNELS: "the backends the steps are compiled with",
        SERVING: "addresses, ports, metrics and the registry",
        MULTIHOST: "one process per host of a slice that spans hosts (engine.multihost); on GKE taken from a"
        " LeaderWorkerSet's LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX when --coordinator is empty",
        SECURITY: "tokens and TLS (docs/security.md)",
    }

    max_seq_len: int | Literal["auto"] = _auto("max_seq_len")
    dtype: Literal["auto", "float32", "bfloat16"] = _auto("dtype")
    prefill_chunk: int = _engine_field("prefill_chunk", WORKER_PREFILL_CHUNK)
    # on in the worker process (its decode step's host dispatch hidden behind the device; EngineConfig, built in
    # code by tests and benchmarks, keeps one step at a time, whose step counts the scheduler tests assert)
    async_decode: bool = _engine_field("async_decode", True)
    model: str = opt("", "Hugging Face checkpoint folder or fsspec URL (config.json + *.safetensors)", MODEL)
    model_id: str = opt("", "model id reported to clients and the registry (empty: the model path)", MODEL)
    quantization: Literal["none", "int8", "int4"] = opt(
        "none",
        "weight-only quantization of the base model's linear projections at load: int8 = symmetric"
        " per-output-channel int8, int4 = symmetric int4 with a scale per group of 128 inputs, two values a"
        " byte (activations, KV cache, embeddings, head and adapters keep the model dtype); a checkpoint written"
        " by `loraserve quantize` is served as written",
        MODEL,
    )
    quantize_lm_head: bool = opt(
        False,
        "with --quantization int8|int4, quantize the head (lm_head) too, the same way: a decode step reads it at"
        " a quarter (int8) or an eighth (int4) of f32's bytes; a model that ties the head to its embedding keeps"
        " the embedding for the lookup and adds the quantized head",
        MODEL,
    )
    host: str = opt(
        "127.0.0.1", "interface to bind: the gRPC port (unless --listen) and --http-port", SERVING
    )
    port: int = opt(50061, "gRPC port to bind (0 picks a free one)", SERVING)
    listen: str = opt(
        "",
        LISTEN_HELP + "; the worker registers unix:/absolute/path unless --advertise-address",
        SERVING,
    )
    adapter_dir: str = opt(
        "",
        "folder (or fsspec URL) of PEFT adapter folders served by name (when no registry is set)",
        ADAPTERS,
    )
    lora_import_prefixes: str = opt(
        "",
        "comma-separated folders or fsspec URL prefixes that POST /v1/load_lora_adapter may load a lora_path"
        " from (vLLM's runtime LoRA API; a worker without a registry only; empty: no path is accepted)",
        ADAPTERS,
    )
    registry: str = opt(
        "",
        "registry address, host:port or unix:PATH: adapters come from it, and the worker registers and"
        " heartbeats (empty: no registry)",
        SERVING,
    )
    advertise_address: str = opt(
        "",
        "address the routers dial to reach this worker, host:port or unix:/absolute/path (empty: the one it"
        " serves on: host and the port bound, or --listen's socket)",
        SERVING,
    )
    cache_dir: str = opt(
        "",
        "local disk cache of adapter blobs fetched from the registry, keyed by sha256 (empty: none)",
        ADAPTERS,
    )
    metrics_port: int = opt(0, "Prometheus /metrics port (0 = off)", SERVING)
    http_port: int = opt(
        0,
        "OpenAI-compatible HTTP API port, also serving /health, and /metrics when there is no --metrics-port"
        " (0 = off)",
        SERVING,
    )
    metrics_top_adapters: int = opt(
        20, "adapters with per-adapter metric series of their own (the rest are summed as 'other')", SERVING
    )
    metrics_compat: Literal["", "vllm"] = opt(
        "",
        "also export the model-server protocol under vLLM's metric names (vllm:num_requests_waiting,"
        " vllm:kv_cache_usage_perc, vllm:lora_requests_info, ...): what the llm-d / Gateway API Inference"
        " Extension router scrapes without a custom mapping",
        SERVING,
    )
    registry_token: str = opt("", "bearer token presented to the registry", SECURITY)
    registry_tls_ca: str = opt("", "PEM CA of the registry's certificate (TLS to the registry)", SECURITY)
    compilation_cache_dir: str = opt(
        "",
        "folder for compiled programs (JAX persistent cache): a restart with the same model and shapes warms"
        " up from disk (empty: off)",
        KERNELS,
    )
    warmup: bool = opt(
        True,
        "compile every program the worker can run before it reports SERVING, so no request ever waits for a"
        " compilation; off (development, smoke runs): serve at once and compile each shape on first use",
        KERNELS,
    )

    coordinator: str = opt(
        "",
        "host:port of process 0 (the leader), where jax.distributed's coordinator listens; the leader's step"
        " channel is the next port (empty: one host)",
        MULTIHOST,
    )
    num_processes: int = opt(1, "processes (hosts) of the worker; their devices form one mesh", MULTIHOST)
    process_id: int = opt(
        0, "this process's index: 0 leads (serves, schedules), the others follow", MULTIHOST
    )
    multihost_timeout: float = opt(
        60.0,
        "seconds the processes wait for one another at start-up, and that a silent or dead process is allowed"
        " before the group reports NOT_SERVING and exits 3 (the LeaderWorkerSet restarts it)",
        MULTIHOST,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_listen_flags(self.listen, self.host)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> WorkerConfig:
        return config_from_env(cls, ENV_PREFIX, env, overrides)

    def engine_config(self) -> EngineConfig:
        """The engine's fields, ``auto`` left as it is (``resolve_engine_config`` resolves it)."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})
