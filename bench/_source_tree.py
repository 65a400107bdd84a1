"""Import ``loraserve`` from the repository this file is in, installed or not (``bench/*.py``, ``bench/device.sh``).

``pyproject.toml`` maps each room (``worker/``, ``kernels/``, ``protos/``, ...) to ``loraserve.<room>``; an
install makes that mapping, a bare copy of the repository (an accelerator machine where nothing can be
installed) does not. :func:`use` loads ``command/__init__.py`` as the package, with the repository root as
a second folder for its submodules, so ``loraserve.worker`` is ``worker/`` either way. The root itself stays
off ``sys.path``, where ``kernels/`` would shadow Hugging Face's ``kernels`` (transformers looks for it), and
``bench/`` is taken off (``python bench/x.py`` puts it first), where ``bench/kernels.py`` would do the same.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def use() -> Path:
    """Make ``import loraserve`` this repository's; returns its root."""
    bench = ROOT / "bench"
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != bench]
    if "loraserve" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "loraserve",
            ROOT / "command" / "__init__.py",
            submodule_search_locations=[str(ROOT / "command"), str(ROOT)],
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["loraserve"] = module
        spec.loader.exec_module(module)
    return ROOT
