"""bench/hlo_diff.py compare: names, parameter numbers and metadata do not count; an instruction does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BEFORE = """HloModule jit_wrapped, entry_computation_layout={(f32[4]{0}, f32[4]{0})->f32[4]{0}}

ENTRY %main.3 (params__w.1: f32[4], cache_0.1: f32[4]) -> f32[4] {
  %params__w.1 = f32[4]{0} parameter(0), metadata={op_name="params" source_file="a.py" source_line=3}
  %cache_0.1 = f32[4]{0} parameter(1)
  ROOT %add.2 = f32[4]{0} add(%params__w.1, %cache_0.1), metadata={op_name="jit(step)/add"}
}
"""
RENAMED = BEFORE.replace("params__w", "state_params_w").replace("parameter(0)", "parameter(1)", 1)
CHANGED = BEFORE.replace("add(", "multiply(")


def _compare(tmp_path: Path, after: str) -> tuple[int, dict]:
    for name, text in (("before", BEFORE), ("after", after)):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "module_0007.jit_wrapped.cpu_after_optimizations.txt").write_text(text)
    proc = subprocess.run(
        [sys.executable, "bench/hlo_diff.py", "compare", str(tmp_path / "before"), str(tmp_path / "after")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_renamed_inputs_compile_the_same(tmp_path) -> None:
    rc, out = _compare(tmp_path, RENAMED)
    assert (rc, out["identical"]) == (0, True)
    assert out["modules"]["jit_wrapped"] == {"before": 1, "after": 1, "identical": 1}


def test_a_changed_instruction_is_a_difference(tmp_path) -> None:
    rc, out = _compare(tmp_path, CHANGED)
    assert (rc, out["identical"]) == (1, False)
    assert out["modules"]["jit_wrapped"] == {"before": 1, "after": 1, "identical": 0}
