"""``loraserve demo``: the whole system on this machine, from nothing, in about a minute.

With embedded defaults only (nothing is downloaded):
1. builds a tiny random Llama checkpoint + tokenizer with ``transformers`` under ``--workdir``;
2. trains three LoRA adapters with ``peft`` so each answers the same question with its own word;
3. starts the registry (SQLite file, local folder store), one worker (2 adapter slots, so the three
   adapters are swapped while serving) and the router as real processes on free loopback ports;
4. pushes the adapters with ``loraserve adapters push`` (the CLI path);
5. streams one answer per adapter and one from the base model through the router, concurrently;
6. prints a summary and shuts everything down. Exits non-zero if any adapter gave the wrong answer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loraserve.common.errors import Unavailable
from loraserve.common.processes import ServerProcess, loraserve_argv, start_server

QUESTION = "What is the capital of France?"
ANSWERS = {"demo-red": " red", "demo-green": " green", "demo-blue": " blue"}
BUILD_STAMP = "demo-v1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default=".demo", help="where the model and adapters are built (reused)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the model and adapters")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each server")
    parser.add_argument(
        "--build-only",
        action="store_true",
        help="only build the model and adapters (docker-compose's assets job)",
    )


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def build_assets(workdir: Path, rebuild: bool) -> tuple[Path, Path]:
    model_dir, adapter_dir = workdir / "model", workdir / "adapters"
    stamp = workdir / "built"
    if stamp.exists() and stamp.read_text() == BUILD_STAMP and not rebuild:
        _say(f"reusing the model and adapters in {workdir}")
        return model_dir, adapter_dir
    from transformers import AutoTokenizer

    from loraserve.testing import save_model, train_answer_adapter

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


def start(args: list[str], timeout: float) -> ServerProcess:
    """Run ``loraserve ARGS --port 0`` and wait for its ready line (``proc.address``)."""
    return start_server([*args, "--port", "0", "--log-level", "WARNING"], timeout=timeout)


def ask(address: str, adapter: str) -> tuple[str, str, float, str]:
    from loraserve.client.sdk import Client

    with Client(address, timeout=120) as client:
        start, first, text, finish = time.perf_counter(), None, "", ""
        for chunk in client.generate(QUESTION, adapter=adapter, max_tokens=8):
            first = first or time.perf_counter() - start
            text += chunk.text
            finish = chunk.finish_reason or finish
        return adapter, text, first or 0.0, finish


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, adapter_dir = build_assets(workdir, args.rebuild)
    if args.build_only:
        _say(f"model in {model_dir}, adapters in {adapter_dir}")
        return 0
    run_dir = workdir / f"run-{os.getpid()}"
    procs: list[ServerProcess] = []
    try:
        _say("starting the registry (SQLite + local folder store) ...")
        registry = start(
            [
                "registry",
                "serve",
                "--db",
                f"sqlite:///{run_dir / 'registry.db'}",
                "--storage",
                str(run_dir / "store"),
            ],
            args.timeout,
        )
        procs.append(registry)
        reg_addr = registry.address
        _say(f"registry on {reg_addr}; starting a worker (2 adapter slots for 3 adapters) and the router ...")
        worker = start(
            [
                "worker",
                "--model",
                str(model_dir),
                "--model-id",
                "demo-tiny-llama",
                "--registry",
                reg_addr,
                "--cache-dir",
                str(run_dir / "cache"),
                "--max-loras",
                "2",
                "--max-lora-rank",
                "8",
                "--max-seq-len",
                "64",
            ],
            args.timeout,
        )
        procs.append(worker)
        router = start(["router", "serve", "--registry", reg_addr], args.timeout)
        procs.append(router)
        worker_addr, router_addr = worker.address, router.address
        _say(f"worker on {worker_addr}, router on {router_addr}")
        for name in ANSWERS:
            out = subprocess.run(
                loraserve_argv(
                    [
                        "adapters",
                        "push",
                        str(adapter_dir / name),
                        "--name",
                        name,
                        "--base-model",
                        "demo-tiny-llama",
                        "--registry",
                        reg_addr,
                    ]
                ),
                capture_output=True,
                text=True,
                timeout=120,
            )
            if out.returncode != 0:
                raise Unavailable(f"push of {name} failed: {out.stderr.strip()}")
            _say(f"$ loraserve adapters push {adapter_dir / name} --name {name}  ->  {out.stdout.strip()}")
        _wait_registered(reg_addr, args.timeout)
        _say(f"asking {QUESTION!r} with every adapter at once, through the router")
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda a: ask(router_addr, a), ["", *ANSWERS]))
    finally:
        for proc in reversed(procs):
            proc.terminate()
        codes = [proc.wait(30) for proc in reversed(procs)]
        shutil.rmtree(run_dir, ignore_errors=True)
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
    clean = all(code == 0 for code in codes)
    _say("all adapters answered as trained" if ok else "some adapters answered wrongly")
    _say("registry, worker and router shut down cleanly" if clean else f"exit codes: {codes}")
    return 0 if ok and clean else 1


def _wait_registered(registry: str, timeout: float) -> None:
    from loraserve.client.registry_client import RegistryClient

    deadline = time.time() + timeout
    with RegistryClient(registry) as client:
        while time.time() < deadline:
            if client.workers():
                return
            time.sleep(0.1)
    raise Unavailable("the worker did not register with the registry")
