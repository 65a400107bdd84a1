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
# Every step runs under `timeout`; STEP_DEADLINE_S (default 540) bounds all of them together.
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
            (cd /tmp && python3 -c 'import jax, loraserve.worker.engine, torch, peft, transformers, grpc
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
            # shellcheck disable=SC2086
            JUNIT_DIR=$OUT timeout -s INT "$(left)" bash "$ROOT/tests/tpu.sh" ${PYTEST_ARGS:-} >"$OUT/pytest.log" 2>&1
            echo "tests: exit $?"
            grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/pytest.log" | tail -60
            ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
