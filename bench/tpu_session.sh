#!/usr/bin/env bash
# bench/tpu_session.sh: set up a bare TPU VM that reaches no package index, then run steps on it.
#
#   make wheelhouse WHEELHOUSE=.whl-tpu   # here, where pip reaches an index (docs/tpu.md)
#   OUT=/tmp/out bash bench/tpu_session.sh install attention tests   # there, from the checkout's root
#
# Steps, in the order given:
#   install    pip-installs loraserve and what it needs into $SITE (default /tmp/loraserve-site) from the
#              wheelhouse $WHEELHOUSE (default .whl-tpu), plus what the host's own index has (PIP_INDEX,
#              default file:///opt/pypi/simple; torch's CPU build from PIP_FIND_LINKS, default /opt/wheels),
#              and appends $SITE to PYTHONPATH: the host's own JAX and libtpu stay first
#   attention  bench/attention.py over head sizes and page sizes -> $OUT/attention.json
#   tests      tests/tpu.sh, what `make test-tpu` runs (PYTEST_ARGS passed on; TPU_TESTS, TPU_STACK_TESTS pick
#              files) -> $OUT/pytest.log, $OUT/tpu-tests.xml, $OUT/tpu-stack.xml
#   bench      the TPU benchmark set (below) -> $OUT/bench-<sub-step>.log each, merged into $OUT/tpu-bench.json
#              (bench/tpu_bench.py), which is also printed as the last line
# Every step runs under `timeout`; STEP_DEADLINE_S (default 540) bounds all of them together.
#
# The bench step (`OUT=/tmp/out bash bench/tpu_session.sh install bench`): its sub-steps in this order, each under
# its own `timeout`, all within TPU_BENCH_DEADLINE_S (default 450; never past STEP_DEADLINE_S); a sub-step that
# would get less than its minimum (45, 120, 90 s) is not started and is recorded as not run:
#   kernels  bench/kernels.py --scan --dtype bfloat16 per shape of TPU_BENCH_SCAN_SHAPES (default "8b"; also
#            8b-attn) at TPU_BENCH_SCAN_BATCHES (default "16 64 128"; distinct rank-16 adapters = batch): every
#            LoRA backend, Pallas compiled (its decode kernel and, as pallas-tiled, the tiled kernels it replaced),
#            over 8 distinct layers (TPU_BENCH_KERNEL_BACKENDS: only those); at most TPU_BENCH_KERNELS_S (200) each
#   decode   bench/decode.py --shape $TPU_BENCH_SHAPE (default 3b: Llama-3.2-3B-shaped, 28 layers, bf16: 7.2 GB
#            with its embedding) --skip-hf at TPU_BENCH_BATCHES (default "16 64"; distinct adapters = batch),
#            one engine per backend of TPU_BENCH_ENGINES (default "xla_grouped pallas xla_onehot"; each engine's
#            base, one-adapter and distinct-adapters rows), TPU_BENCH_ROUNDS (default 2) timed rounds; at most
#            TPU_BENCH_DECODE_S (360). A JSON line after each engine (--emit-partial): a cut run keeps what finished
#   quant    bench/decode.py --engines none --quantization: that model's base quantized as each of TPU_BENCH_QUANT
#            (default "int8"; int4, int8_head, int4_head) at TPU_BENCH_QUANT_BATCHES (default "16"), its speed-up
#            taken against the decode sub-step's xla-grouped base (auto on a TPU); at most TPU_BENCH_QUANT_S (120)
#   speculative  bench/speculative.py --dtype bfloat16 (not in the default set): plain against speculative decoding
#            (n-gram and predicted outputs) at TPU_BENCH_SPEC_BATCHES (default "1 16") on TPU_BENCH_SPEC_SHAPE
#            (default bench: hidden 1024, 8 layers); at most TPU_BENCH_SPEC_S (240)
# TPU_BENCH_PROFILE=1 also traces every kernels row (bench/kernels.py --profile $OUT/profile-<shape>) and sums the
# traces per op into $OUT/trace-summary-<shape>.log (bench/trace_summary.py; its JSON on the last line).
# TPU_BENCH_STEPS (default "kernels decode quant") picks sub-steps; TPU_BENCH_TINY=1 runs them at the tiny shapes
# (batches 4), on a CPU too (tests/bench runs it); TPU_BENCH_WORK (default /tmp/loraserve-bench) keeps the built
# model for a later call on the same machine (and JAX_COMPILATION_CACHE_DIR the programs); TPU_BENCH_HBM_GBS
# (default 819, a v5e) is what the rows' hbm_fraction divides by. PYTHON (default python3) runs the scripts.
#
# Chip time of the default set, estimated before any run of it (a fresh machine, no compilation cache; every
# sub-step's JSON reports its XLA compilations, "compiles": count and seconds, to replace these guesses):
#   kernels 8b  ~75 s: ~15 s to start and open the chip; ~15 s drawing 0.47 G weights and 0.49 G adapter values
#               on the host; 18 scan programs (3 batches x dense + 5 backends; one layer's body each, Pallas through
#               Mosaic) at ~2 s a compile + 24 small pool-layout programs ~10 s; timing ~2 s (18 x 21 runs)
#   decode 3b   ~350 s (250-500): ~25 s to start (jax, torch, transformers); ~40 s building the model on the host
#               (3.6 G values on every core, 7.2 GB and 64 adapters' 3.1 GB written); ~20 s for the machine's peaks
#               and loading it; then 6 engines (3 backends x 2 batches) at ~45 s: ~4-6 programs of the unrolled
#               28-layer model each (prefill buckets, decode: 28 big programs for 6 engines at the tiny shape on a
#               CPU) at ~5-10 s a compile (docs/tpu.md's ~0.3-2 s for 2-layer test models, scaled by depth), and
#               ~10 s loading 16-64 adapters and timing 3 rows x 5 rounds of ~32 steps (a base step reads 6.6-7.0
#               GB: 8.0-8.6 ms at 819 GB/s)
#   quant int8  ~95 s: ~20 s to start, ~25 s reading and quantizing 2.8 G weights on the host, one engine ~45 s
#   measured    2026-12-07 on a fresh v5e machine: kernels 8b 86 s (47 compiles, 28 s of them); decode 3b at batch
#               64 with two engines killed at 320 s before its first engine finished (building the model and its
#               first engine's programs take longer than guessed; bench/decode.py now logs each phase's time):
#               build the model in a call of its own first (decode.py --build-only into TPU_BENCH_WORK), then
#               time the engines in the next call on the same machine
#   total       ~515 s central against 450: the quant sub-step (last) runs only when kernels and decode leave it
#               90 s, i.e. when compiles come in under the central guess; alone it costs ~140 s (it builds the
#               model itself: TPU_BENCH_STEPS=quant TPU_BENCH_DEADLINE_S=200)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
SITE=${SITE:-/tmp/loraserve-site}
WHEELHOUSE=${WHEELHOUSE:-$ROOT/.whl-tpu}
PIP_INDEX=${PIP_INDEX:-file:///opt/pypi/simple}
PIP_FIND_LINKS=${PIP_FIND_LINKS:-/opt/wheels}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/loraserve-jax-cache}
export PYTHONUNBUFFERED=1
START=$SECONDS
DEADLINE=${STEP_DEADLINE_S:-540}
left() { echo $((DEADLINE - (SECONDS - START))); }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE
PYTHON=${PYTHON:-python3}
csv() { local IFS=,; echo "$*"; }

# bench_run NAME CAP MIN ARGS...: `$PYTHON ARGS...` from /tmp for at most CAP s and what the bench step has left
# (bench_end), not started with less than MIN s; into $OUT/bench-NAME.log (the command on its first line);
# records NAME:RC:LIMIT:SECONDS
bench_run() {
    local name=$1 cap=$2 min=$3 t0=$SECONDS limit rc=0
    shift 3
    limit=$((bench_end - SECONDS - 20))  # -k 15 below, and the merge, after the limit
    ((limit > cap)) && limit=$cap
    echo "\$ $PYTHON $*" >"$OUT/bench-$name.log"
    if ((limit < min)); then
        echo "not run: ${limit} s left, ${min} s needed" >>"$OUT/bench-$name.log"
        rc=200
    else
        (cd /tmp && timeout -s INT -k 15 "$limit" "$PYTHON" "$@") >>"$OUT/bench-$name.log" 2>&1 || rc=$?
    fi
    bench_steps+=("$name:$rc:$limit:$((SECONDS - t0))")
    echo "bench $name: exit $rc after $((SECONDS - t0)) s (limit $limit s)"
    grep -v '^{' "$OUT/bench-$name.log" | grep -v -i 'warn' | tail -8 | cut -c1-200
}

# The generated gRPC modules the engine imports are build outputs a checkout does not carry: make them
# (grpc_tools) or take the installed loraserve's (the wheelhouse's build of the same contract)
bench_protos() {
    [[ -f $ROOT/protos/v1/inference_pb2.py ]] && return 0
    if (cd "$ROOT" && "$PYTHON" protos/build.py >/dev/null 2>&1); then
        echo "bench: protos generated"
        return 0
    fi
    local dir find='import os, loraserve.protos.v1.inference_pb2 as m; print(os.path.dirname(m.__file__))'
    dir=$(cd /tmp && "$PYTHON" -c "$find" 2>/dev/null) && cp "$dir"/*_pb2*.py "$ROOT/protos/v1/" \
        && echo "bench: protos from the installed loraserve ($dir)"
}

bench_main() {
    local cap tiny=${TPU_BENCH_TINY:-0} shape scan_shapes scan_batches batches quant_batches spec_shape spec_batches
    local work t0=$SECONDS
    cap=$(left)
    ((cap > ${TPU_BENCH_DEADLINE_S:-450})) && cap=${TPU_BENCH_DEADLINE_S:-450}
    bench_end=$((SECONDS + cap))
    bench_steps=()
    if ((tiny)); then
        shape=tiny scan_shapes=tiny scan_batches=4 batches=4 quant_batches=4 spec_shape=tiny spec_batches=2
    else
        shape=3b scan_shapes="8b" scan_batches="16 64 128" batches="16 64" quant_batches=16 spec_shape=bench
        spec_batches=1,16
    fi
    spec_shape=${TPU_BENCH_SPEC_SHAPE:-$spec_shape}
    # shellcheck disable=SC2086
    spec_batches=$(csv ${TPU_BENCH_SPEC_BATCHES:-$spec_batches})
    shape=${TPU_BENCH_SHAPE:-$shape}
    scan_shapes=${TPU_BENCH_SCAN_SHAPES:-$scan_shapes}
    # shellcheck disable=SC2086  # the lists' words, joined by commas
    scan_batches=$(csv ${TPU_BENCH_SCAN_BATCHES:-$scan_batches}) batches=$(csv ${TPU_BENCH_BATCHES:-$batches})
    # shellcheck disable=SC2086
    quant_batches=$(csv ${TPU_BENCH_QUANT_BATCHES:-$quant_batches})
    work=${TPU_BENCH_WORK:-/tmp/loraserve-bench}/$shape
    local common=(--shape "$shape" --dtype bfloat16 --skip-hf --no-extra --no-json --skip-ttft --lazy-compile
                  --emit-partial --rounds "${TPU_BENCH_ROUNDS:-2}" --workdir "$work")
    echo "bench: ${TPU_BENCH_STEPS:-kernels decode quant} within $cap s"
    for sub in ${TPU_BENCH_STEPS:-kernels decode quant}; do
        case $sub in
            kernels)
                for s in $scan_shapes; do
                    extra=()  # TPU_BENCH_PROFILE=1: a trace per row, summed by bench/trace_summary.py
                    [[ -n ${TPU_BENCH_PROFILE:-} ]] && extra=(--profile "$OUT/profile-$s")
                    # shellcheck disable=SC2086
                    [[ -n ${TPU_BENCH_KERNEL_BACKENDS:-} ]] && extra+=(--backends "$(csv $TPU_BENCH_KERNEL_BACKENDS)")
                    bench_run "kernels-$s" "${TPU_BENCH_KERNELS_S:-200}" 45 "$ROOT/bench/kernels.py" --scan \
                        --shape "$s" --dtype bfloat16 --batch "$scan_batches" "${extra[@]}"
                    if [[ -n ${TPU_BENCH_PROFILE:-} ]]; then
                        "$PYTHON" "$ROOT/bench/trace_summary.py" "$OUT/profile-$s" >"$OUT/trace-summary-$s.log" 2>&1
                    fi
                done
                ;;
            decode | quant)
                bench_protos
                if [[ $sub == decode ]]; then
                    # shellcheck disable=SC2086
                    bench_run decode "${TPU_BENCH_DECODE_S:-360}" 120 "$ROOT/bench/decode.py" "${common[@]}" \
                        --batch "$batches" --engines "$(csv ${TPU_BENCH_ENGINES:-xla_grouped pallas xla_onehot})"
                else
                    # shellcheck disable=SC2086
                    bench_run quant "${TPU_BENCH_QUANT_S:-120}" 90 "$ROOT/bench/decode.py" "${common[@]}" \
                        --batch "$quant_batches" --engines none --quantization "$(csv ${TPU_BENCH_QUANT:-int8})"
                fi
                ;;
            speculative)
                bench_protos
                bench_run speculative "${TPU_BENCH_SPEC_S:-240}" 90 "$ROOT/bench/speculative.py" --dtype bfloat16 \
                    --batch "$spec_batches" --rounds "${TPU_BENCH_ROUNDS:-2}" --workdir "$work-speculative" \
                    --shape "$spec_shape" --lazy-compile
                ;;
            *) echo "bench: unknown sub-step $sub (kernels, decode, quant, speculative)" >&2 ;;
        esac
    done
    local envs=() var
    for var in $(compgen -v TPU_BENCH_); do envs+=(--env "$var=${!var}"); done
    "$PYTHON" "$ROOT/bench/tpu_bench.py" "$OUT" "${bench_steps[@]}" --seconds $((SECONDS - t0)) \
        --command "bash bench/tpu_session.sh $BENCH_ARGS" --hbm-gbs "${TPU_BENCH_HBM_GBS:-819}" "${envs[@]}"
}
BENCH_ARGS="$*"

# The suite runs against the installed package (tests/tpu.sh): a wheelhouse built before the checkout's last
# change would test older code. Stop at once then (make wheelhouse again, or deploy/wheelhouse.py --project-only).
check_installed() {
    if ! python3 "$ROOT/deploy/wheelhouse.py" --compare-installed "$SITE" | head -20; then
        echo "loraserve in $SITE is not this checkout's (the files above): rebuild the wheelhouse" >&2
        exit 3
    fi
}

for step in "$@"; do
    echo "== $step ($(left) s left)"
    case $step in
        install)
            t0=$SECONDS
            # a warm machine keeps $SITE between calls: install again only when the wheelhouse changed
            stamp=$(cd "$WHEELHOUSE" && sha256sum ./*.whl | sha256sum | cut -c1-16)
            if [[ -f $SITE/.wheelhouse-stamp && $(cat "$SITE/.wheelhouse-stamp") == "$stamp" ]]; then
                echo "install: $SITE already holds wheelhouse $stamp"
            else
                rm -rf "$SITE"
                PIP_CONFIG_FILE=/dev/null timeout "$(left)" python3 -m pip install --isolated -q --no-compile \
                    --disable-pip-version-check --target "$SITE" --index-url "$PIP_INDEX" \
                    --find-links "$WHEELHOUSE" --find-links "$PIP_FIND_LINKS" \
                    "loraserve[worker,registry,demo]" "torch==2.13.0" pytest-timeout 2>&1 | tail -20 \
                    && echo "$stamp" >"$SITE/.wheelhouse-stamp"
                echo "install: $((SECONDS - t0)) s"
            fi
            check_installed
            (cd /tmp && python3 -c 'import jax, loraserve.engine.engine, torch, peft, transformers, grpc
print("jax", jax.__version__, jax.devices(), "torch", torch.__version__, "peft", peft.__version__,
      "transformers", transformers.__version__, "grpc", grpc.__version__)' 2>&1 | tail -3)
            ;;
        attention)
            cap=$(left); ((cap > ${ATTENTION_DEADLINE_S:-180})) && cap=${ATTENTION_DEADLINE_S:-180}
            # shellcheck disable=SC2086
            (cd /tmp && timeout -s INT "$cap" python3 "$ROOT/bench/attention.py" ${ATTENTION_ARGS:-}) \
                >"$OUT/attention.log" 2>&1
            echo "attention: exit $?"; tail -1 "$OUT/attention.log" >"$OUT/attention.json"
            grep -v '^{"bench"' "$OUT/attention.log" | tail -40
            ;;
        tests)
            [[ -d $SITE/loraserve ]] && check_installed
            # shellcheck disable=SC2086
            JUNIT_DIR=$OUT timeout -s INT "$(left)" bash "$ROOT/tests/tpu.sh" ${PYTEST_ARGS:-} >"$OUT/pytest.log" 2>&1
            echo "tests: exit $?"
            grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/pytest.log" | tail -60
            ;;
        bench)
            bench_main
            ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
