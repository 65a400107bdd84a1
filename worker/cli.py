"""``loraserve worker``: load a base model, warm up, serve Inference + WorkerAdmin over gRPC.

Every flag has an environment twin ``LORASERVE_WORKER_<FLAG>`` (flags win).
"""

from __future__ import annotations

import argparse
import asyncio

from loraserve.common.config import SECURITY_HELP, add_config_flags, config_from_args
from loraserve.common.errors import InvalidArgument
from loraserve.worker.config import ENV_PREFIX, WorkerConfig

HELP = {
    **SECURITY_HELP,
    "model": "Hugging Face checkpoint folder or fsspec URL (config.json + *.safetensors)",
    "model_id": "model id reported to clients and the registry (default: the model path)",
    "host": "address to bind",
    "port": "port to bind (0 picks a free one)",
    "adapter_dir": "folder (or fsspec URL) of PEFT adapter folders served by name (when no registry is set)",
    "registry": "registry host:port: fetch adapters from it, register and heartbeat",
    "advertise_address": "host:port the router uses to reach this worker (default: host:port bound)",
    "cache_dir": "local disk cache of adapter blobs fetched from the registry (keyed by sha256)",
    "metrics_port": "Prometheus /metrics port (0 = off)",
    "http_port": "OpenAI-compatible HTTP API port, also serving /health, and /metrics when there is no"
    " --metrics-port (0 = off)",
    "metrics_top_adapters": "adapters with per-adapter metric series of their own (the rest are summed as 'other')",
    "registry_token": "bearer token presented to the registry",
    "registry_tls_ca": "PEM CA of the registry's certificate",
    "max_batch_size": "decode rows per step",
    "max_seq_len": "context length: prompt plus new tokens",
    "max_loras": "adapter slots on the device",
    "max_lora_rank": "largest adapter rank a slot holds",
    "max_cpu_loras": "adapters kept in host memory after eviction",
    "max_mix": "adapters one request's weighted mix may name (a mix's summed rank must fit --max-lora-rank)",
    "max_waiting": "queued requests before RESOURCE_EXHAUSTED",
    "prefill_per_step": "prompts admitted between two decode steps (prefilled together in one packed call)",
    "max_prefill_tokens": "tokens one packed prefill computes at most (prompts x padded length); a longer"
    " prompt is prefilled alone",
    "prefill_chunk": "chunked prefill: prompt tokens computed per step at most, a decode step of the running"
    " rows between two chunks, so a long prompt never stalls them for more than one chunk (0 = whole prompts)",
    "min_prefill_bucket": "smallest prefill token bucket (buckets double up to --max-seq-len)",
    "default_max_tokens": "new tokens of a request that sets no max_tokens",
    "kernel_backend": "multi-LoRA backend: auto (cpu on a CPU when its C++ kernels build, else xla-grouped),"
    " cpu, xla (= xla-grouped: rows grouped by slot), xla-grouped, xla-onehot (one-hot over all slots),"
    " pallas or reference",
    "attention_backend": "decode attention over the paged KV cache: auto (pallas on a TPU, cpu on a CPU where the"
    " C++ kernels build, else xla), xla (gather each row's pages, dense attention), cpu (C++ kernel reading the"
    " pages in place) or pallas (JAX's TPU paged-attention kernel; sliding-window layers use xla; interpreted,"
    " slowly, off a TPU)",
    "linear_backend": "the base model's bfloat16 projections of a few rows (decode steps, up to 24 rows):"
    " auto (cpu on a CPU with AVX-512 BF16 where the C++ kernels build, else xla), xla or cpu (C++ kernel"
    " streaming the weights with prefetch; widens to float32 on CPUs without bf16 dot products);"
    " tensor-parallel workers use xla",
    "dtype": "compute dtype: float32 or bfloat16",
    "lora_dtype": "dtype of the adapter slot pools, float32 or bfloat16 (empty: --dtype); bfloat16 halves"
    " the bytes each decode step reads for its adapters",
    "tensor_parallel_size": "devices one model is split over (tensor parallelism on a 'model' mesh: heads,"
    " MLP, vocab, KV heads and the LoRA slot pools split Megatron-style); must divide the heads and the"
    " intermediate size and be at most the visible devices (default 1: one device)",
    "kv_page_size": "tokens per KV-cache page (the cache is one pool of pages; each sequence holds only the"
    " pages its tokens fill)",
    "kv_pages": "pages in the KV pool, the reserved null page included (0: from --kv-cache-bytes)",
    "kv_cache_bytes": "KV pool size in bytes when --kv-pages is 0 (both 0: --max-batch-size full contexts)",
    "enable_prefix_caching": "reuse the KV pages of a prompt prefix computed under the same adapter content"
    " (sha256) or the base model; never across adapters",
    "compilation_cache_dir": "folder for compiled programs (JAX persistent cache): a restart with the same"
    " model and shapes warms up from disk (empty: off)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, WorkerConfig, ENV_PREFIX, HELP)
    parser.add_argument("--log-level", default="INFO")


async def serve(config: WorkerConfig, stop: asyncio.Event | None = None) -> None:
    from loraserve.adapters.sources import LocalAdapterSource
    from loraserve.common.server import run_server
    from loraserve.worker.checkpoint import load_checkpoint
    from loraserve.worker.engine import Engine
    from loraserve.worker.server import worker_services
    from loraserve.worker.tokenizer import load_tokenizer

    if config.compilation_cache_dir:
        from loraserve.worker.engine import enable_compilation_cache

        enable_compilation_cache(config.compilation_cache_dir)
    checkpoint = load_checkpoint(config.model, dtype=config.dtype)
    tokenizer = load_tokenizer(config.model)
    if config.registry:
        from loraserve.worker.registry_source import RegistryAdapterSource

        source = RegistryAdapterSource(
            config.registry,
            cache_dir=config.cache_dir or None,
            token=config.registry_token,
            tls_ca=config.registry_tls_ca,
        )
    else:
        source = LocalAdapterSource(config.adapter_dir or None)
    engine = Engine(checkpoint, config.engine_config(), source=source)
    if config.metrics_port or config.http_port:  # the HTTP API serves /metrics too
        from loraserve.worker.metrics import register_engine_metrics

        register_engine_metrics(engine, config.metrics_top_adapters)
    model_id = config.model_id or config.model
    services = worker_services(engine, tokenizer, model_id)
    background = []
    if config.http_port:
        from loraserve.httpapi import http_server
        from loraserve.worker.http import WorkerHttpBackend

        backend = WorkerHttpBackend(services.inference, model_id, config.model)
        # /metrics leave through the metrics port when there is one (docs/security.md)
        http = http_server(
            backend, config.host, config.http_port, config.security(), metrics=not config.metrics_port
        )
        background.append(http.run)

    async def warmup() -> None:
        await asyncio.get_running_loop().run_in_executor(None, engine.start)

    def register(port: int):
        from loraserve.worker.registration import Registration

        advertise = config.advertise_address or f"{config.host}:{port}"
        return Registration(
            engine,
            config.registry,
            advertise,
            model_id,
            token=config.registry_token,
            tls_ca=config.registry_tls_ca,
            model_aliases=hub_names(config.model),
        ).run()

    if config.registry:
        background.append(register)
    await run_server(
        services,
        config.host,
        config.port,
        config.security(),
        metrics_port=config.metrics_port,
        warmup=warmup,
        background=background,
        cleanup=[engine.stop],
        stop=stop,
    )


def hub_names(model: str) -> list[str]:
    """The checkpoint's Hugging Face repo id (``_name_or_path`` in config.json) when it reads as one."""
    from loraserve.adapters.refs import is_hub_id
    from loraserve.worker.checkpoint import read_config

    name = read_config(model).get("_name_or_path") or ""
    return [name] if isinstance(name, str) and is_hub_id(name) else []


def run(args: argparse.Namespace) -> int:
    from loraserve.common.observability import setup_logging

    setup_logging(args.log_level)
    config = config_from_args(WorkerConfig, ENV_PREFIX, args)
    if not config.model:
        raise InvalidArgument("loraserve worker: --model (or LORASERVE_WORKER_MODEL) is required")
    asyncio.run(serve(config))
    return 0
