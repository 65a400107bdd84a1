"""What a system test compares against: the same requests on a one-device engine in the test's process."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from loraserve.adapters.sources import LocalAdapterSource
from loraserve.worker.checkpoint import load_checkpoint
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine
from loraserve.worker.requests import EngineRequest, Finished, Sampling
from tests.worker.fake_engine import Collector


def reference_tokens(
    model_dir: Path,
    adapters: Mapping[str, Path],
    requests: Sequence[tuple[str, list[int]]],
    config: EngineConfig,
    max_tokens: int = 6,
) -> list[list[int]]:
    """Greedy tokens of each ``(adapter name or "", prompt)``, served one at a time; adapters as ``name@1``."""
    source = LocalAdapterSource()
    for name, path in adapters.items():
        source.register(f"{name}@1", str(path))
    engine = Engine(load_checkpoint(str(model_dir)), config, source=source)
    engine.start()
    try:
        outs = []
        for adapter, prompt in requests:
            collected = Collector()
            sampling = Sampling(max_tokens=max_tokens, ignore_eos=True)
            ref = f"{adapter}@1" if adapter else ""
            engine.submit(EngineRequest(uuid.uuid4().hex, ref, list(prompt), sampling, collected))
            assert collected.done.wait(60), f"the reference engine did not finish {adapter or 'base'}"
            assert isinstance(collected.end, Finished), collected.end
            outs.append(collected.tokens)
        return outs
    finally:
        engine.stop()
