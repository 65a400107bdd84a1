"""``loraserve worker``: load a base model, warm up, serve Inference + WorkerAdmin over gRPC.

Every flag has an environment twin ``LORASERVE_WORKER_<FLAG>`` (flags win), but the logging flags, whose
twins are ``LORASERVE_LOG_LEVEL`` and ``LORASERVE_LOG_FORMAT`` for every server (common.config). The options,
their help and their groups are the fields of ``worker.config.WorkerConfig``; ``--dtype`` and
``--max-seq-len`` default to ``auto``, resolved against the checkpoint's config.json
(``engine.config.resolve_engine_config``) before it loads.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from loraserve.common.addresses import parse_address, serve_address
from loraserve.common.config import (
    add_config_flags,
    add_logging_flags,
    config_from_args,
    setup_logging_from_args,
)
from loraserve.common.errors import InvalidArgument
from loraserve.worker.config import ENV_PREFIX, WorkerConfig

if TYPE_CHECKING:  # loraserve --help imports no JAX
    from loraserve.engine.multihost import Cluster, FollowerChannel, LeaderChannel

log = logging.getLogger("loraserve.worker")
LOST_EXIT_AFTER_S = 10.0  # a multi-host leader that lost a process drains (NOT_SERVING), then exits by then


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, WorkerConfig, ENV_PREFIX)
    add_logging_flags(parser)


async def serve(config: WorkerConfig, stop: asyncio.Event | None = None) -> int:
    """Serve until ``stop`` (or a signal); the exit status: 0, or ``multihost.EXIT_PEER_LOST``."""
    from loraserve.adapters.sources import LocalAdapterSource
    from loraserve.common.server import run_server
    from loraserve.engine import multihost
    from loraserve.engine.config import resolve_engine_config
    from loraserve.engine.engine import Engine
    from loraserve.engine.jax_runner import JaxRunner
    from loraserve.models.checkpoint import load_checkpoint, open_checkpoint, read_config
    from loraserve.worker.server import worker_services
    from loraserve.worker.tokenizer import load_tokenizer

    if config.compilation_cache_dir:
        from loraserve.engine.engine import enable_compilation_cache

        enable_compilation_cache(config.compilation_cache_dir)
    hf_config = read_config(config.model)
    engine_config = resolve_engine_config(config.engine_config(), hf_config)  # auto dtype and context
    cluster = multihost.cluster_from(
        config.coordinator, config.num_processes, config.process_id, config.multihost_timeout
    )
    channel, lost = None, []  # lost: why a multi-host leader stopped, when a process of its group was lost
    if cluster is not None:
        stop = stop or asyncio.Event()
        channel = _join_cluster(cluster, config.model, stop, lost, serving_settings(config, engine_config))
    # a model split over devices is read shard by shard as the runner places it: each process reads the
    # rows and columns its devices hold, and no device (nor host) ever holds the whole model
    split = engine_config.tensor_parallel_size > 1 or cluster is not None
    load = open_checkpoint if split else load_checkpoint
    checkpoint = load(
        config.model,
        dtype=engine_config.dtype,
        quantization=config.quantization,
        quantize_lm_head=config.quantize_lm_head,
    )
    if cluster is not None and not cluster.leader:  # a follower replays the leader's device calls
        multihost.follow(JaxRunner(checkpoint, engine_config), channel)
        return 0
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
    runner = JaxRunner(checkpoint, engine_config, channel=channel)
    engine = Engine(checkpoint, engine_config, source=source, runner=runner)
    if config.metrics_port or config.http_port:  # the HTTP API serves /metrics too
        from loraserve.worker.metrics import register_engine_metrics

        model_id = config.model_id or config.model
        register_engine_metrics(engine, config.metrics_top_adapters, config.metrics_compat, model_id)
    model_id = config.model_id or config.model
    services = worker_services(engine, tokenizer, model_id)
    background = []
    if config.http_port:
        from loraserve.httpapi import http_server
        from loraserve.worker.http_backend import WorkerHttpBackend

        prefixes = [p for p in config.lora_import_prefixes.split(",") if p]
        backend = WorkerHttpBackend(services.inference, model_id, config.model, import_prefixes=prefixes)
        # /metrics leave through the metrics port when there is one (docs/security.md)
        http = http_server(
            backend, config.host, config.http_port, config.security(), metrics=not config.metrics_port
        )
        background.append(http.run)

    async def warmup() -> None:
        await asyncio.get_running_loop().run_in_executor(None, lambda: engine.start(warmup=config.warmup))

    def register(served: str):
        from loraserve.worker.registration import Registration

        # the address the ready line prints: host and the port bound, or unix:/absolute/path
        advertise = config.advertise_address or served
        return Registration(
            engine,
            config.registry,
            advertise,
            model_id,
            token=config.registry_token,
            tls_ca=config.registry_tls_ca,
            model_aliases=hub_names(hf_config),
        ).run()

    if config.registry:
        background.append(register)
    await run_server(
        services,
        serve_address(config.listen, config.host, config.port),
        config.security(),
        metrics_port=config.metrics_port,
        warmup=warmup,
        background=background,
        cleanup=[engine.stop] + ([channel.close] if channel is not None else []),
        stop=stop,
    )
    if lost:
        log.error("multi-host: exiting %d: %s", multihost.EXIT_PEER_LOST, lost[0])
        return multihost.EXIT_PEER_LOST
    return 0


# the resolved engine settings that shape the compiled programs a multi-host worker's followers replay (the
# leader's own scheduling, adapter cache and events may differ between hosts)
PROGRAM_SETTINGS = (
    "max_batch_size", "max_seq_len", "max_loras", "max_lora_rank", "max_mix", "prefill_per_step",
    "max_prefill_tokens", "prefill_chunk", "min_prefill_bucket", "kernel_backend", "dtype", "lora_dtype",
    "tensor_parallel_size", "attention_backend", "linear_backend", "kv_page_size", "kv_pages", "kv_cache_bytes",
    "matmul_precision",
)  # fmt: skip


def serving_settings(config: Any, engine_config: Any) -> dict[str, str]:
    """The flags every host of a multi-host worker must share, as the step channel's handshake compares them:
    the resolved engine's PROGRAM_SETTINGS and how the checkpoint is quantized at load."""
    out = {name: str(getattr(engine_config, name)) for name in PROGRAM_SETTINGS}
    out.update(quantization=str(config.quantization), quantize_lm_head=str(config.quantize_lm_head))
    return out


def _join_cluster(
    cluster: Cluster,
    model: str,
    stop: asyncio.Event,
    lost: list[str],
    settings: dict[str, str] | None = None,
) -> LeaderChannel | FollowerChannel:
    """A multi-host worker's step channel (``engine.multihost``), then ``jax.distributed``: the channel's
    handshake first, as it refuses by name what jax.distributed would abort the process on. A leader that
    loses a process appends the reason to ``lost`` and sets ``stop`` (the drain: NOT_SERVING), then exits
    whatever still runs after ``LOST_EXIT_AFTER_S``; a follower exits at once."""
    from loraserve.engine import multihost

    digest = multihost.checkpoint_digest(model)
    if cluster.leader:
        loop = asyncio.get_running_loop()

        def on_lost(reason: str) -> None:
            lost.append(reason)
            loop.call_soon_threadsafe(stop.set)
            threading.Timer(LOST_EXIT_AFTER_S, os._exit, (multihost.EXIT_PEER_LOST,)).start()

        channel = multihost.LeaderChannel(cluster, digest, on_lost, settings)
    else:
        channel = multihost.FollowerChannel(cluster, digest, lost=_exit_lost, settings=settings)
    multihost.initialize(cluster)
    return channel


def _exit_lost(reason: str) -> None:
    """A follower whose leader is gone exits at once (its main thread may be inside a device call)."""
    from loraserve.engine.multihost import EXIT_PEER_LOST

    log.error("multi-host: exiting %d: %s", EXIT_PEER_LOST, reason)
    logging.shutdown()
    os._exit(EXIT_PEER_LOST)


def hub_names(hf_config: dict) -> list[str]:
    """The checkpoint's Hugging Face repo id (``_name_or_path`` in its config.json) when it reads as one."""
    from loraserve.adapters.refs import is_hub_id

    name = hf_config.get("_name_or_path") or ""
    return [name] if isinstance(name, str) and is_hub_id(name) else []


def run(args: argparse.Namespace) -> int:
    setup_logging_from_args(args)
    config = config_from_args(WorkerConfig, ENV_PREFIX, args)
    if not config.model:
        raise InvalidArgument("loraserve worker: --model (or LORASERVE_WORKER_MODEL) is required")
    if config.advertise_address:  # refused now, before the model loads, rather than at every registration
        parse_address(config.advertise_address, what="--advertise-address")
    code = asyncio.run(serve(config))
    if code:  # a multi-host group lost a process: skip jax.distributed's exit barrier, which would abort
        logging.shutdown()
        os._exit(code)
    return code
