"""``loraserve worker``: load a base model, warm up, serve Inference + WorkerAdmin over gRPC.

Every flag has an environment twin ``LORASERVE_WORKER_<FLAG>`` (flags win).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import fields

from loraserve.worker.config import ENV_PREFIX, WorkerConfig

HELP = {
    "model": "Hugging Face checkpoint folder or fsspec URL (config.json + *.safetensors)",
    "model_id": "model id reported to clients and the registry (default: the model path)",
    "host": "address to bind",
    "port": "port to bind (0 picks a free one)",
    "adapter_dir": "folder (or fsspec URL) of PEFT adapter folders served by name (when no registry is set)",
    "registry": "registry host:port: fetch adapters from it, register and heartbeat",
    "advertise_address": "host:port the router uses to reach this worker (default: host:port bound)",
    "cache_dir": "local disk cache of adapter blobs fetched from the registry (keyed by sha256)",
    "metrics_port": "Prometheus /metrics port (0 = off)",
    "auth_tokens": "comma-separated bearer tokens accepted for Generate (empty: no auth)",
    "admin_tokens": "comma-separated bearer tokens accepted for every RPC",
    "tls_cert": "PEM certificate: serve TLS",
    "tls_key": "PEM key of --tls-cert",
    "tls_client_ca": "PEM CA: require client certificates (mTLS)",
    "registry_token": "bearer token presented to the registry",
    "registry_tls_ca": "PEM CA of the registry's certificate",
    "max_batch_size": "decode rows per step",
    "max_seq_len": "context length: prompt plus new tokens",
    "max_loras": "adapter slots on the device",
    "max_lora_rank": "largest adapter rank a slot holds",
    "max_cpu_loras": "adapters kept in host memory after eviction",
    "max_waiting": "queued requests before RESOURCE_EXHAUSTED",
    "kernel_backend": "multi-LoRA backend: auto (cpu on a CPU when its C++ kernels build, else xla-grouped),"
    " cpu, xla (= xla-grouped: rows grouped by slot), xla-grouped, xla-onehot (one-hot over all slots),"
    " pallas or reference",
    "dtype": "compute dtype: float32 or bfloat16",
    "lora_dtype": "dtype of the adapter slot pools, float32 or bfloat16 (empty: --dtype); bfloat16 halves"
    " the bytes each decode step reads for its adapters",
    "compilation_cache_dir": "folder for compiled programs (JAX persistent cache): a restart with the same"
    " model and shapes warms up from disk (empty: off)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in fields(WorkerConfig):
        flag = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        parser.add_argument(
            flag,
            type=type(f.default),
            default=None,
            help=f"{HELP[f.name]} (env {env}; default {f.default!r})",
        )
    parser.add_argument("--log-level", default="INFO")


async def serve(config: WorkerConfig, ready_line: bool = True) -> None:
    from loraserve.adapters.sources import LocalAdapterSource
    from loraserve.common.security import ServerSecurity
    from loraserve.worker.checkpoint import load_checkpoint
    from loraserve.worker.engine import Engine
    from loraserve.worker.server import build_server, set_serving
    from loraserve.worker.tokenizer import load_tokenizer

    log = logging.getLogger("loraserve.worker")
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
    if config.metrics_port:
        from loraserve.common.observability import start_metrics
        from loraserve.worker.metrics import register_engine_metrics

        register_engine_metrics(engine)
        start_metrics(config.metrics_port, log)
    model_id = config.model_id or config.model
    security = ServerSecurity.from_strings(
        config.auth_tokens, config.admin_tokens, config.tls_cert, config.tls_key, config.tls_client_ca
    )
    server, port, health_servicer = build_server(
        engine, tokenizer, model_id, f"{config.host}:{config.port}", security
    )
    await set_serving(health_servicer, False)
    await server.start()
    log.info("worker bound to %s:%d; warming up", config.host, port)
    await asyncio.get_running_loop().run_in_executor(None, engine.start)
    await set_serving(health_servicer, True)
    registration = None
    if config.registry:
        from loraserve.worker.registration import Registration

        registration = asyncio.create_task(
            Registration(
                engine,
                config.registry,
                config.advertise_address or f"{config.host}:{port}",
                model_id,
                token=config.registry_token,
                tls_ca=config.registry_tls_ca,
            ).run()
        )
    if ready_line:
        print(f"loraserve worker serving on {config.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining")
    await set_serving(health_servicer, False)
    if registration is not None:
        registration.cancel()
    await server.stop(grace=5)
    engine.stop()


def run(args: argparse.Namespace) -> int:
    from loraserve.common.observability import setup_logging

    setup_logging(args.log_level)
    overrides = {f.name: getattr(args, f.name) for f in fields(WorkerConfig)}
    config = WorkerConfig.from_env(**overrides)
    if not config.model:
        raise SystemExit("loraserve worker: --model (or LORASERVE_WORKER_MODEL) is required")
    asyncio.run(serve(config))
    return 0
