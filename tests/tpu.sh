#!/usr/bin/env bash
# tests/tpu.sh (`make test-tpu`): the suite's TPU selection, in one pytest process (one process at a time can
# hold a TPU chip), against loraserve as installed (pip install '.[tpu,registry,demo]', or from a wheelhouse:
# docs/tpu.md), run from outside the checkout: from inside, pytest puts the checkout first on sys.path, where its
# room folders (`kernels/` among them) would be found before installed packages of the same names.
# Arguments go to both pytest runs (e.g. -k, -x); TPU_TESTS and TPU_STACK_TESTS replace the two selections (an
# empty one skips its run); JUNIT_DIR=DIR writes each run's JUnit XML there.
#
# The selection: every test file that means something on one chip (kernels compiled for it, attention, the
# engine, parity with transformers/peft, sampling, structured outputs, MoE, quantized bases, row isolation,
# the planner, compilation counts), then the serving stack over unix sockets. A test in it that means something
# on a CPU only carries `pytest.mark.cpu_only(reason)` and is reported skipped with that reason.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
DEFAULT_TESTS=(
    tests/worker/test_platforms_agree.py
    tests/kernels
    tests/worker/test_step_contract.py
    tests/worker/test_model_compilations.py
    tests/worker/test_known_answer.py
    tests/worker/test_model_parity.py
    tests/worker/test_families.py
    tests/worker/test_engine.py
    tests/worker/test_paged_engine.py
    tests/worker/test_async_decode.py
    tests/worker/test_chunked_prefill.py
    tests/worker/test_lora_parity.py
    tests/worker/test_adapter_ops.py
    tests/worker/test_dora.py
    tests/worker/test_dora_worker.py
    tests/worker/test_embed_lora.py
    tests/worker/test_mixes.py
    tests/worker/test_mix_refs.py
    tests/worker/test_sampling.py
    tests/worker/test_sampling_controls.py
    tests/worker/test_structured_outputs.py
    tests/worker/test_logprobs.py
    tests/worker/test_prompt_logprobs.py
    tests/worker/test_prompt_logprobs_parity.py
    tests/worker/test_moe.py
    tests/worker/test_moe_lora.py
    tests/worker/test_quantization.py
    tests/worker/test_row_isolation.py
    tests/worker/test_planner.py
    tests/worker/test_bf16_files.py
    tests/worker/test_speculative.py
)
# the second run: the serving stack as processes over unix sockets, the worker on the chip (this pytest
# process computes its references on the CPU: LORASERVE_TEST_SERVERS_ON=tpu, tests/conftest.py)
DEFAULT_STACK_TESTS=(
    tests/e2e/test_tpu_stack.py
    tests/e2e/test_unix_sockets.py
)
if [[ -n ${TPU_TESTS+x} ]]; then read -r -a TESTS <<<"$TPU_TESTS"; else TESTS=("${DEFAULT_TESTS[@]}"); fi
if [[ -n ${TPU_STACK_TESTS+x} ]]; then read -r -a STACK <<<"$TPU_STACK_TESTS"; else STACK=("${DEFAULT_STACK_TESTS[@]}"); fi
# TPU_SHARD=i/n: the i-th of n parts of the in-process selection (every n-th entry; the stack run with the last
# part), for machines lent for less time than the whole selection takes (it compiles for the chip: > 10 min)
if [[ -n ${TPU_SHARD:-} ]]; then
    IFS=/ read -r shard shards <<<"$TPU_SHARD"
    if ! [[ $shard =~ ^[0-9]+$ && $shards =~ ^[0-9]+$ ]] || ((shard < 1 || shard > shards)); then
        echo "TPU_SHARD must be i/n with 1 <= i <= n, got $TPU_SHARD" >&2
        exit 2
    fi
    part=()
    for i in "${!TESTS[@]}"; do
        ((i % shards == shard - 1)) && part+=("${TESTS[$i]}")
    done
    TESTS=("${part[@]}")
    ((shard == shards)) || STACK=()
fi
cd "${TMPDIR:-/tmp}"
run() {
    "$PYTHON" -m pytest --rootdir="$ROOT" -c "$ROOT/pyproject.toml" --import-mode=append -p no:cacheprovider "$@"
}
status=0
if ((${#TESTS[@]})); then
    run ${JUNIT_DIR:+--junitxml="$JUNIT_DIR/tpu-tests.xml"} "${TESTS[@]/#/$ROOT/}" "$@" || status=$?
fi
if ((${#STACK[@]})); then
    LORASERVE_TEST_SERVERS_ON=tpu run ${JUNIT_DIR:+--junitxml="$JUNIT_DIR/tpu-stack.xml"} "${STACK[@]/#/$ROOT/}" "$@" \
        || status=$((status ? status : $?))
fi
exit "$status"
