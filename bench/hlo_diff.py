"""Did a refactor change what the worker compiles? Dump the optimised HLO of every compiled step, compare two dumps.

    python bench/hlo_diff.py dump /tmp/hlo-before     # on the old code
    python bench/hlo_diff.py dump /tmp/hlo-after      # on the new code
    python bench/hlo_diff.py compare /tmp/hlo-before /tmp/hlo-after

``dump`` builds tiny Llama (f32) and Gemma 2 (bf16) checkpoints, warms up a ``JaxRunner`` on the xla-grouped,
xla-onehot and cpu LoRA backends (every prefill bucket, every decode plan variant) with XLA dumping each
module after optimisation. ``compare`` pairs the modules of each kind in compilation order and compares
their instructions with names, parameter numbers and source metadata taken out (a refactor renames and
reorders inputs; the instructions are what runs). The last line is JSON: per module kind, how many pairs
are identical; the exit status is 1 when any differs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import _source_tree  # in bench/, first on sys.path

KINDS = ("jit_wrapped", "jit__write_slot", "jit__dora_scales")  # the steps, the slot write, DoRA's norms


def dump(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    os.environ["XLA_FLAGS"] = f"--xla_dump_to={out} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
    _source_tree.use()  # loraserve from this repository, installed or not
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.jax_runner import JaxRunner
    from loraserve.models.checkpoint import load_checkpoint
    from loraserve.testing import save_model

    work = Path(tempfile.mkdtemp(prefix="hlo-diff-"))
    for family, dtype in (("llama", "float32"), ("gemma2", "bfloat16")):
        checkpoint = load_checkpoint(str(save_model(work / family, family)), dtype)
        for backend in ("xla-grouped", "xla-onehot", "cpu"):
            config = EngineConfig(
                max_batch_size=4,
                max_seq_len=64,
                max_loras=2,
                max_lora_rank=8,
                kernel_backend=backend,
                dtype=dtype,
            )
            JaxRunner(checkpoint, config).warmup()
    shutil.rmtree(work)
    print(json.dumps({"dumped": str(out)}))


def instructions(path: Path) -> collections.Counter:
    """The module's instructions, each without its names, parameter number and metadata."""
    out: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        if not re.match(r"^\s+(ROOT )?[%\w]", line):
            continue  # headers and the stack-frame tables name Python code, not instructions
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        line = re.sub(r"%[\w.\-]+", "%v", line)
        line = re.sub(r"parameter\(\d+\)", "parameter(_)", line)
        out[re.sub(r"^\s*(ROOT )?[\w.\-]+ = ", r"\1v = ", line).strip()] += 1
    return out


def modules(folder: Path, kind: str) -> list[Path]:
    found = folder.glob(f"module_*.{kind}.*after_optimizations.txt")
    return sorted(found, key=lambda p: int(re.search(r"module_(\d+)", p.name).group(1)))


def compare(before: Path, after: Path) -> int:
    result, same = {}, True
    for kind in KINDS:
        a, b = modules(before, kind), modules(after, kind)
        identical = sum(instructions(x) == instructions(y) for x, y in zip(a, b, strict=False))
        result[kind] = {"before": len(a), "after": len(b), "identical": identical}
        same = same and len(a) == len(b) == identical
    print(json.dumps({"bench": "hlo_diff", "identical": same, "modules": result}))
    return 0 if same else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dump").add_argument("out", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.cmd == "dump":
        dump(args.out)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
