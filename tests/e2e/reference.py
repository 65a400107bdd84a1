"""What a system test compares against: the same requests on a one-device engine in the test's process."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from loraserve.adapters.mixes import MixPart, is_mix, mix_ref, parse_mix
from loraserve.engine.config import EngineConfig
from loraserve.engine.request import EngineRequest, Finished, Sampling
from tests.engines import started_engine
from tests.worker.fake_engine import Collector


def versioned(adapter: str) -> str:
    """The ref the registry resolves ``adapter`` (a name, a mix of names, or "" for the base) to: ``@1``."""
    if is_mix(adapter):
        return mix_ref([MixPart(f"{p.ref}@1", p.weight) for p in parse_mix(adapter)])
    return f"{adapter}@1" if adapter else ""


def reference_tokens(
    model_dir: Path,
    adapters: Mapping[str, Path],
    requests: Sequence[tuple[str, list[int]]],
    config: EngineConfig,
    max_tokens: int = 6,
) -> list[list[int]]:
    """Greedy tokens of each ``(adapter name, mix of names or "", prompt)``, served one at a time; adapters as
    ``name@1``."""
    paths = {f"{name}@1": path for name, path in adapters.items()}
    with started_engine(model_dir, config, paths, warmup=False) as engine:  # compiles what it runs
        outs = []
        for adapter, prompt in requests:
            collected = Collector()
            sampling = Sampling(max_tokens=max_tokens, ignore_eos=True)
            ref = versioned(adapter)
            engine.submit(EngineRequest(uuid.uuid4().hex, ref, list(prompt), sampling, collected))
            assert collected.done.wait(60), f"the reference engine did not finish {adapter or 'base'}"
            assert isinstance(collected.end, Finished), collected.end
            outs.append(collected.tokens)
        return outs
