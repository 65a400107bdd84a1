"""``loraserve demo``: build a tiny model and adapters locally, serve them from a real worker, stream answers.

What it does, with embedded defaults only (nothing is downloaded):
1. builds a tiny random Llama checkpoint + tokenizer with ``transformers`` under ``--workdir``;
2. trains three LoRA adapters with ``peft`` so each answers the same question with its own word;
3. starts ``loraserve worker`` as a real process on a free loopback port (2 adapter slots, so the
   three adapters must be swapped while serving);
4. streams one answer per adapter and one from the base model over gRPC, concurrently;
5. prints a summary and shuts the worker down. Exits non-zero if any adapter gave the wrong answer.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

QUESTION = "What is the capital of France?"
ANSWERS = {"demo-red": " red", "demo-green": " green", "demo-blue": " blue"}
BUILD_STAMP = "demo-v1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default=".demo", help="where the model and adapters are built (reused)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the model and adapters")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the worker")


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def build_assets(workdir: Path, rebuild: bool) -> tuple[Path, Path]:
    model_dir, adapter_dir = workdir / "model", workdir / "adapters"
    stamp = workdir / "built"
    if stamp.exists() and stamp.read_text() == BUILD_STAMP and not rebuild:
        _say(f"reusing the model and adapters in {workdir}")
        return model_dir, adapter_dir
    from transformers import AutoTokenizer

    from worker.testing import save_model, train_answer_adapter

    _say("building a tiny random Llama checkpoint (transformers) ...")
    save_model(model_dir, "llama", seed=0)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tok(QUESTION)["input_ids"]
    for i, (name, answer) in enumerate(ANSWERS.items()):
        t = time.perf_counter()
        train_answer_adapter(
            model_dir, adapter_dir / name, prompt, tok(answer)["input_ids"] + [tok.eos_token_id], seed=i
        )
        _say(
            f"trained adapter {name!r} to answer {answer.strip()!r} with peft ({time.perf_counter() - t:.1f}s)"
        )
    stamp.write_text(BUILD_STAMP)
    return model_dir, adapter_dir


def start_worker(model_dir: Path, adapter_dir: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "client.cli",
        "worker",
        "--model",
        str(model_dir),
        "--adapter-dir",
        str(adapter_dir),
        "--port",
        "0",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--max-seq-len",
        "64",
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    deadline = time.time() + timeout
    assert proc.stdout is not None
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "serving on" in line:
            return proc, line.strip().rsplit(" ", 1)[-1]
    proc.kill()
    raise SystemExit("the worker did not come up")


def ask(address: str, adapter: str) -> tuple[str, str, float, str]:
    import grpc

    from protos.v1 import inference_pb2 as pb
    from protos.v1 import inference_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        start, first, text, finish = time.perf_counter(), None, "", ""
        for r in stub.Generate(
            pb.GenerateRequest(adapter=adapter, text=QUESTION, sampling=pb.SamplingParams(max_tokens=8)),
            timeout=120,
        ):
            first = first or time.perf_counter() - start
            text += r.text
            if r.finish_reason:
                finish = pb.FinishReason.Name(r.finish_reason).removeprefix("FINISH_REASON_").lower()
        return adapter, text, first or 0.0, finish


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, adapter_dir = build_assets(workdir, args.rebuild)
    _say("starting `loraserve worker` (2 adapter slots for 3 adapters) ...")
    proc, address = start_worker(model_dir, adapter_dir, args.timeout)
    try:
        _say(f"worker ready on {address}; asking {QUESTION!r} with every adapter at once")
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda a: ask(address, a), ["", *ANSWERS]))
    finally:
        proc.terminate()
        proc.wait(30)
    print()
    print(f"{'adapter':14s} {'answer':10s} {'finish':7s} {'TTFT':>8s}  check")
    ok = True
    for adapter, text, ttft, finish in results:
        want = ANSWERS.get(adapter)
        good = want is None or text == want
        ok &= good
        check = "-" if want is None else ("ok" if good else f"WRONG (wanted {want!r})")
        print(f"{adapter or '(base model)':14s} {text!r:10s} {finish:7s} {ttft * 1000:6.0f}ms  {check}")
    print()
    _say(
        "all adapters answered as trained; worker shut down cleanly"
        if ok
        else "some adapters answered wrongly"
    )
    return 0 if ok and proc.returncode == 0 else 1
