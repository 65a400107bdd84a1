"""The known-answer test, as a user would run it: four trained adapters, two slots, one busy worker.

Each adapter is trained with peft so that it answers the same question with its own word; all four and
the base model are asked concurrently over gRPC through a worker with max_loras=2, so slots are swapped
mid-traffic. Every request must get its own adapter's answer, exactly.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from loraserve.engine.config import EngineConfig
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.protos.v1 import inference_pb2_grpc, worker_admin_pb2, worker_admin_pb2_grpc
from loraserve.testing import train_answer_adapter
from tests.worker.serving import running_worker

QUESTION = "What is the capital of France?"
ANSWERS = {"ans-red": " red", "ans-green": " green", "ans-blue": " blue", "ans-cat": " cat"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(llama_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    prompt = tok(QUESTION)["input_ids"]
    root = tmp_path_factory.mktemp("trained")
    out = {}
    for i, (name, answer) in enumerate(ANSWERS.items()):
        ids = tok(answer)["input_ids"] + [tok.eos_token_id]
        out[name] = train_answer_adapter(llama_dir, root / name, prompt, ids, seed=i)
    return out


def test_every_request_gets_its_own_adapters_answer(llama_dir, trained) -> None:
    cfg = EngineConfig(max_batch_size=4, max_seq_len=64, max_loras=2, max_lora_rank=8)
    with running_worker(llama_dir, cfg, trained, warmup=False) as worker:
        stub = inference_pb2_grpc.InferenceStub(worker.channel)

        def ask(adapter: str) -> tuple[str, str, int]:
            req = pb.GenerateRequest(adapter=adapter, text=QUESTION, sampling=pb.SamplingParams(max_tokens=8))
            responses = list(stub.Generate(req, timeout=120))
            return "".join(r.text for r in responses), responses[-1].adapter, responses[-1].finish_reason

        base_text, _, _ = ask("")
        jobs = [name for _ in range(3) for name in [*ANSWERS, ""]]  # 15 concurrent requests, 5 targets
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(ask, jobs))
        for adapter, (text, served, finish) in zip(jobs, results, strict=True):
            if adapter:
                assert (text, served, finish) == (ANSWERS[adapter], adapter, pb.FINISH_REASON_EOS)
            else:
                assert text == base_text and served == ""
        assert base_text not in ANSWERS.values()
        # 4 adapters through 2 slots: at least 2 evictions while other requests were queued or running
        assert worker.engine.snapshot().adapter_loads >= 4
        admin = worker_admin_pb2_grpc.WorkerAdminStub(worker.channel)
        slots = admin.ListSlots(worker_admin_pb2.ListSlotsRequest()).slots
        assert len(slots) == 2 and all(s.refcount == 0 for s in slots)
