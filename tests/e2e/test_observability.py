"""A worker process with --metrics-port and JSON logs: Prometheus text with real values, one JSON object per log line."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request

import pytest

from loraserve.client.sdk import Client
from tests.e2e.compose_local import free_port
from tests.e2e.procs import loraserve_process, wait_healthy

pytestmark = pytest.mark.e2e


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not exported"
    return float(m.group(1))


def test_worker_metrics_and_json_logs(llama_dir, adapter_dirs, tmp_path) -> None:
    adapters = tmp_path / "adapters"
    shutil.copytree(adapter_dirs["all-r4"], adapters / "all-r4")
    port = free_port()
    args = [
        "worker",
        "--model",
        str(llama_dir),
        "--adapter-dir",
        str(adapters),
        "--port",
        "0",
        "--max-seq-len",
        "64",
        "--max-loras",
        "2",
        "--metrics-port",
        str(port),
    ]
    with loraserve_process(args, env={"LORASERVE_LOG_FORMAT": "json"}) as proc:
        wait_healthy(proc.address)
        with Client(proc.address) as client:
            for adapter in ("all-r4", "all-r4", ""):
                assert (
                    client.complete(
                        [5, 17, 33], adapter=adapter, max_tokens=4, ignore_eos=True
                    ).completion_tokens
                    == 4
                )
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert _metric(text, "loraserve_time_to_first_token_seconds_count", '{server="worker"}') == 3
        assert _metric(text, "loraserve_inter_token_latency_seconds_count", '{server="worker"}') == 9
        assert _metric(text, "loraserve_generation_tokens_total", '{server="worker"}') == 12
        assert _metric(text, "loraserve_prompt_tokens_total", '{server="worker"}') == 9
        assert _metric(text, "loraserve_adapter_loads_total") == 1
        assert _metric(text, "loraserve_adapter_load_seconds_count") == 1
        assert _metric(text, "loraserve_lora_slots_used") == 1 and _metric(text, "loraserve_lora_slots") == 2
        assert _metric(text, "loraserve_requests_running") == 0
        assert (
            'loraserve_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
            in text
        )
    records = [json.loads(line) for line in proc.log if line.startswith("{")]
    finished = [r for r in records if r["message"] == "finished"]
    assert len(finished) == 3 and {r["adapter"] for r in finished} == {"all-r4", ""}
    assert all(len(r["request_id"]) == 32 and r["level"] == "INFO" for r in finished)
