"""A real engine (the JAX runner on a saved model) for tests: built, started, and always stopped.

Engines over the fake runner (``Engine(None, config, source, runner=..., model_config=...)``) are built
where they are used; this is the one place that builds engines over a real checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from loraserve.adapters.sources import AdapterSource, LocalAdapterSource
from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.models.checkpoint import Checkpoint, load_checkpoint
from loraserve.models.config import ModelConfig


def local_source(adapters: Mapping[str, str | os.PathLike] | None = None) -> LocalAdapterSource:
    """A local source that serves each ``name -> PEFT folder``."""
    source = LocalAdapterSource()
    for name, path in (adapters or {}).items():
        source.register(name, str(path))
    return source


@contextmanager
def started_engine(
    model: str | os.PathLike | Checkpoint,
    config: EngineConfig,
    adapters: Mapping[str, str | os.PathLike] | None = None,
    *,
    source: AdapterSource | None = None,
    model_config: ModelConfig | None = None,
    warmup: bool = True,
) -> Iterator[Engine]:
    """An engine on ``model`` (a saved model's folder, or a checkpoint already loaded), started (warmed up
    unless ``warmup=False``) and stopped on exit. Adapters come from ``source`` when given, else from a
    local source of ``adapters``."""
    if source is not None and adapters is not None:
        raise TypeError("pass adapters or a source, not both")
    checkpoint = model if isinstance(model, Checkpoint) else load_checkpoint(str(model))
    engine = Engine(
        checkpoint,
        config,
        source if source is not None else local_source(adapters),
        model_config=model_config,
    )
    try:
        engine.start(warmup=warmup)
        yield engine
    finally:
        engine.stop()
