"""What a system test compares against: the same requests on a one-device engine in the test's process."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from loraserve.worker.config import EngineConfig
from loraserve.worker.requests import EngineRequest, Finished, Sampling
from tests.engines import started_engine
from tests.worker.fake_engine import Collector


def reference_tokens(
    model_dir: Path,
    adapters: Mapping[str, Path],
    requests: Sequence[tuple[str, list[int]]],
    config: EngineConfig,
    max_tokens: int = 6,
) -> list[list[int]]:
    """Greedy tokens of each ``(adapter name or "", prompt)``, served one at a time; adapters as ``name@1``."""
    versioned = {f"{name}@1": path for name, path in adapters.items()}
    with started_engine(model_dir, config, versioned) as engine:
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
