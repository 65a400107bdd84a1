"""The serving stack on a chip: a registry, a worker and a router as real processes over unix sockets (a TPU
host allows no TCP), PEFT adapters answered as PEFT computes them, 64 adapters swapped through 8 slots.

Run by ``make test-tpu``'s second pytest run (``tests/tpu.sh``: ``LORASERVE_TEST_SERVERS_ON=tpu``): the worker
process takes the chip, this process computes the references with transformers + peft on the CPU. Skipped
elsewhere (``LORASERVE_TEST_SERVERS_ON=cpu`` runs it all on a CPU).

Two Llama-shaped models of head size 64 (hidden 256, 4 heads, the head size of Llama-3.2-1B) and 128 (2 heads,
Llama-3-8B's): the head sizes JAX's TPU attention kernel refuses and takes (kernels/attention.py).

* float32 (``--dtype float32``: ``--matmul-precision auto`` traces the steps at ``highest``): greedy tokens
  equal PEFT's, token for token.
* bfloat16: the worker's every greedy token is PEFT's float32 argmax or within :data:`BF16_MARGIN` of it, judged
  on PEFT's logits along the worker's own tokens (bf16 weights and activations move these logits by up to a few
  hundredths; a wrong token elsewhere would be a bug, not rounding).
* 64 adapters through 8 slots, each request its own adapter: every answer equals PEFT's for the 8 checked, and
  no compilation after warm-up (``JAX_LOG_COMPILES``: none logged after the ready line).
* A cancelled stream and a missed deadline free their rows and slots (``ListSlots`` refcounts back to 0).
* The arrays the worker holds on the device (``WorkerInfo.device_array_bytes``) are at least ``loraserve plan``'s
  weights + KV cache + slot pools for the same shapes and at most its total, and so is the device's peak less
  what the runtime keeps for itself (its compiled programs, which the plan does not count; on a CPU the
  runtime reports no device memory).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from loraserve.client.registry_client import RegistryClient
from loraserve.client.sdk import Client
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.protos.v1 import inference_pb2_grpc, worker_admin_pb2, worker_admin_pb2_grpc
from loraserve.testing import make_adapter, save_model
from tests.conftest import with_test_xla_flags
from tests.e2e.procs import inet_sockets, loraserve_process, unix_socket_dir, wait_for_workers
from tests.platform import ON_TPU, SERVERS_ON_TPU
from tests.waiting import settled

pytestmark = [pytest.mark.tpu, pytest.mark.e2e, pytest.mark.slow]

SHAPES = {  # Llama family, 2 layers; head size = hidden / heads
    "h64": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
    "h128": dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1),
}
ADAPTERS = 64  # on the h128 model, SLOTS of them at a time (the parity test uses the first 2 of each model)
SLOTS = 8
CHECKED = 8  # adapters whose answers are compared with PEFT's (a PEFT reference costs ~0.2 s each)
PROMPTS = ([5, 17, 33, 100, 7], [3, 4, 250, 11, 12, 13, 14], [60, 61])
NEW_TOKENS = 8
# bf16: the worker's token may be any whose PEFT f32 logit is within this of the top one. Where a bf16 worker on
# a CPU picked another token than f32 argmax, the f32 logits of the two were at most 0.041 apart (logits of
# magnitude <= 5.2; 2026-12-07): twice that.
BF16_MARGIN = 8e-2
WORKER_SHAPES = [
    "--max-batch-size",
    "4",
    "--max-seq-len",
    "64",
    "--max-lora-rank",
    "8",
    "--min-prefill-bucket",
    "16",
]
COMPILE_LINE = re.compile(
    r"Compiling \w"
)  # what JAX_LOG_COMPILES logs per compilation (tests/e2e/test_multihost.py)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory):
    """``made(name, count) -> (model folder, {adapter name: PEFT folder})``: the model of SHAPES[name] and its
    first ``count`` adapters, made on first use."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tpu-stack")
    models: dict[str, Path] = {}
    adapters: dict[str, dict[str, Path]] = {}

    def get(name: str, count: int) -> tuple[Path, dict[str, Path]]:
        if name not in models:
            models[name] = save_model(root / name, "llama", seed=20 + len(models), **SHAPES[name])
            adapters[name] = {}
        have = adapters[name]
        for a in range(len(have), count):
            folder = root / f"{name}-a{a}"
            base = AutoModelForCausalLM.from_pretrained(str(models[name]))
            make_adapter(base, folder, r=8, alpha=16.0, seed=100 + a, scale=0.08)
            have[f"{name}-a{a}"] = folder
        return models[name], dict(list(have.items())[:count])

    return get


class Peft:
    """transformers + peft on the CPU in float32: greedy tokens and the logits along a sequence."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def _model(self, adapter_dir: Path | None):
        from peft import PeftModel

        if adapter_dir is None:
            return self.base
        import copy

        return PeftModel.from_pretrained(copy.deepcopy(self.base), str(adapter_dir)).eval()

    def logits(self, adapter_dir: Path | None, seq: list[int]) -> np.ndarray:  # [len(seq), V]
        with self.torch.no_grad():
            return self._model(adapter_dir)(self.torch.tensor([seq])).logits[0].float().numpy()

    def greedy(self, adapter_dir: Path | None, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
        model, seq = self._model(adapter_dir), list(prompt)
        with self.torch.no_grad():
            for _ in range(n):
                seq.append(int(model(self.torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(prompt) :]


def _stack(registry_address: str, model: Path, model_id: str, sockets: Path, *flags: str):
    """The worker's arguments: on a unix socket, registered with the registry, JAX logging its compiles."""
    return [
        "worker", "--model", str(model), "--model-id", model_id, "--registry", registry_address,
        "--listen", f"unix:{sockets / (model_id + '.sock')}", *WORKER_SHAPES, *flags,
    ]  # fmt: skip


def _worker_env() -> dict[str, str]:
    return with_test_xla_flags({"JAX_LOG_COMPILES": "1"})


def _compiles(lines: list[str]) -> int:
    return sum(1 for line in lines if COMPILE_LINE.search(line))


def _refcounts_zero(address: str) -> list:
    with grpc.insecure_channel(address) as channel:
        admin = worker_admin_pb2_grpc.WorkerAdminStub(channel)

        def slots():
            return admin.ListSlots(worker_admin_pb2.ListSlotsRequest(), timeout=10).slots

        return settled(slots, lambda s: all(x.refcount == 0 for x in s), timeout=30, interval=0.1)


def _info(address: str) -> worker_admin_pb2.WorkerInfo:
    with grpc.insecure_channel(address) as channel:
        admin = worker_admin_pb2_grpc.WorkerAdminStub(channel)
        return admin.GetWorkerInfo(worker_admin_pb2.GetWorkerInfoRequest(), timeout=10)


def _plan_total(model: Path, info: worker_admin_pb2.WorkerInfo) -> dict:
    args = [
        sys.executable, "-m", "loraserve", "plan", "--model", str(model), "--json", "--dtype", info.dtype,
        "--max-loras", str(info.max_loras), "--max-lora-rank", str(info.max_lora_rank),
        "--batch", str(info.max_batch_size), "--context", str(info.max_seq_len),
    ]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """``(address, sockets folder, push)``: a registry on a unix socket; ``push(adapters, base_model)`` uploads
    the ones it does not hold yet."""
    if ON_TPU:
        pytest.fail("this process holds the chip: run with LORASERVE_TEST_SERVERS_ON=tpu (tests/tpu.sh)")
    root = tmp_path_factory.mktemp("tpu-registry")
    with unix_socket_dir() as sockets:
        args = ["registry", "serve", "--listen", f"unix:{sockets / 'registry.sock'}"]
        args += [
            "--db",
            f"sqlite:///{root / 'r.db'}",
            "--storage",
            str(root / "store"),
            "--lease-seconds",
            "5",
        ]
        with loraserve_process(args) as proc, RegistryClient(proc.address) as client:
            pushed: set[str] = set()

            def push(adapters: dict[str, Path], base_model: str) -> None:
                for adapter, folder in adapters.items():
                    if adapter not in pushed:
                        client.push(folder, adapter, base_model=base_model)
                        pushed.add(adapter)

            yield proc.address, sockets, push


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_peft_adapters_answer_as_peft_computes_them(made, registry, name: str, dtype: str) -> None:
    registry_address, sockets, push = registry
    model, adapters = made(name, 2)
    push(adapters, name)
    checked = list(adapters)
    peft = Peft(model)
    model_id = f"{name}-{dtype}"
    args = _stack(registry_address, model, name, sockets, "--dtype", dtype, "--max-loras", "2")
    with loraserve_process(args, env=_worker_env(), timeout=400) as worker:
        assert worker.address.startswith("unix:")
        info = _info(worker.address)
        assert info.platform == ("tpu" if SERVERS_ON_TPU else "cpu"), model_id
        with Client(worker.address) as client:
            for adapter in [None, *checked]:
                for prompt in PROMPTS:
                    got = client.complete(
                        prompt, adapter=adapter or "", max_tokens=NEW_TOKENS, ignore_eos=True
                    )
                    folder = adapters[adapter] if adapter else None
                    if dtype == "float32":
                        assert got.token_ids == peft.greedy(folder, prompt), (adapter, prompt)
                        continue
                    logits = peft.logits(folder, prompt + got.token_ids[:-1])[len(prompt) - 1 :]
                    top = logits.max(axis=-1)
                    mine = logits[np.arange(NEW_TOKENS), got.token_ids]
                    assert (top - mine <= BF16_MARGIN).all(), (adapter, prompt, (top - mine).tolist())
        assert inet_sockets(worker.popen.pid) == []


def test_64_adapters_through_8_slots_cancel_deadline_and_memory(made, registry) -> None:
    registry_address, sockets, push = registry
    model, adapters = made("h128", ADAPTERS)
    push(adapters, "h128")
    names = list(adapters)
    peft = Peft(model)
    want = {n: peft.greedy(adapters[n], PROMPTS[0]) for n in names[:CHECKED]}
    args = _stack(registry_address, model, "h128", sockets, "--max-loras", str(SLOTS), "--max-cpu-loras", "4")
    with (
        loraserve_process(args, env=_worker_env(), timeout=400) as worker,
        RegistryClient(registry_address) as reg,
    ):
        ready = len(worker.log)  # the ready line: warm-up is over
        assert _compiles(worker.log[:ready]) > 0, (
            "JAX_LOG_COMPILES logged no warm-up compile: the count is blind"
        )
        wait_for_workers(reg, 1, timeout=60)
        router_args = ["router", "serve", "--listen", f"unix:{sockets / 'router.sock'}"]
        router_args += ["--registry", registry_address, "--locate-ttl", "0.2"]
        with loraserve_process(router_args) as router, Client(router.address) as client:
            for round_ in range(2):  # every adapter twice: 64 loads through 8 slots, then again
                for n in names:
                    got = client.complete(PROMPTS[0], adapter=n, max_tokens=NEW_TOKENS, ignore_eos=True)
                    assert got.adapter == f"{n}@1"
                    if n in want:
                        assert got.token_ids == want[n], (round_, n)
            assert inet_sockets(router.popen.pid) == []

        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(worker.address))
        long = pb.GenerateRequest(
            adapter=names[0], tokens=pb.TokenIds(ids=PROMPTS[0]),
            sampling=pb.SamplingParams(max_tokens=50, ignore_eos=True),
        )  # fmt: skip
        call = stub.Generate(long, timeout=120)
        assert next(call).token_ids
        call.cancel()
        _refcounts_zero(worker.address)
        with pytest.raises(grpc.RpcError) as exc:
            for _ in stub.Generate(long, timeout=0.3):
                time.sleep(0.05)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _refcounts_zero(worker.address)

        assert _compiles(worker.log[ready:]) == 0, [
            line for line in worker.log[ready:] if COMPILE_LINE.search(line)
        ]
        info = _info(worker.address)
        plan = _plan_total(model, info)
        if SERVERS_ON_TPU:
            held = plan["weights"] + plan["kv_cache"] + plan["lora_pools"]
            assert held <= info.device_array_bytes <= plan["total"], (info, plan)
            # the runtime's own bytes (compiled programs: ~36 MB here, 4x the arrays; loaded at warm-up, none
            # after) are not the plan's: the peak above them is
            runtime = info.device_bytes_in_use - info.device_array_bytes
            assert runtime > 0 and info.device_peak_bytes_in_use - runtime <= plan["total"], (info, plan)
        else:  # a CPU's runtime reports no device memory
            assert info.device_peak_bytes_in_use == info.device_bytes_limit == info.device_array_bytes == 0
