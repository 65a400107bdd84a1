"""Shared pytest fixtures: PostgreSQL databases of their own, and the marker rules.

A ``postgres`` test runs whenever ``LORASERVE_TEST_POSTGRES_URL`` is set (CI sets it to the local
server) and FAILS, never skips, when the variable is set and the server cannot be reached. Each test
gets a fresh database created for it and dropped afterwards, since the server outlives test runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from loraserve.testing import make_adapter, save_model

POSTGRES_ENV = "LORASERVE_TEST_POSTGRES_URL"
# `tpu` tests (the serving stack on a chip) run where the test process holds a TPU, or with this variable set:
# "tpu" (tests/tpu.sh's second run: the servers the tests start take the chip, this process computes its
# references on the CPU), or "cpu" (everything on this CPU: how a developer checks those tests without a chip)
SERVERS_ON = "LORASERVE_TEST_SERVERS_ON"


# XLA:CPU flags for compile-bound test processes (every engine warms up dozens of tiny-model programs; results
# stay within every stated tolerance). Measured on a 2-core AVX2 machine, one test-model engine's warm-up:
# 20.7 s as users run it, 13.8 s at backend optimisation level 0, 9.0 s with the older (non-MLIR) fusion
# emitters too (which change nothing without level 0), 8.6 s compiling each program as one LLVM module.
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def _test_xla_flags() -> str:
    """:data:`FAST_COMPILE_FLAGS` as this jaxlib takes them: one it no longer knows would abort every JAX
    process, so the set is probed once per run (a JAX start with them) and level 0 alone kept if that fails;
    the answer travels to the test workers and child processes in LORASERVE_TEST_XLA_FLAGS."""
    known = os.environ.get("LORASERVE_TEST_XLA_FLAGS")
    if known is not None:
        return known
    flags = " ".join(FAST_COMPILE_FLAGS)
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"],
        env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        timeout=120,
    )
    if probe.returncode != 0:
        flags = FAST_COMPILE_FLAGS[0]
    os.environ["LORASERVE_TEST_XLA_FLAGS"] = flags
    return flags


TEST_XLA_FLAGS = _test_xla_flags()


def with_test_xla_flags(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (variables on top of this process's) with TEST_XLA_FLAGS added to its XLA_FLAGS: for the server
    processes of compile-bound tests, whose warm-up compiles every bucket and which decode a few tokens (a
    test-model worker warms up from an empty cache in less than half the time; its decode steps are as fast:
    C++ kernels)."""
    env = dict(env or {})
    flags = env.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} {TEST_XLA_FLAGS}".strip()
    return env


def pytest_configure(config: pytest.Config) -> None:
    """One JAX persistent compilation cache for this run, shared with every process it starts.

    Dozens of engines (in-process and in worker subprocesses) compile the same test-model programs;
    each warm-up after the first reads them from disk. Set ``JAX_COMPILATION_CACHE_DIR`` to keep a
    cache across runs. Compilation counting is unaffected: it counts lowerings, which still happen.
    """
    from loraserve.engine.engine import enable_compilation_cache

    # TEST_XLA_FLAGS in the test processes: in-process engines compile in less than half the time. The CPU
    # backend reads XLA_FLAGS once, when it starts (now); the variable is then restored, so servers the tests
    # start as processes run as users run them (they decode thousands of tokens, which level 0 slows) unless
    # a test asks for the flags (with_test_xla_flags). The TP child processes add TEST_XLA_FLAGS themselves.
    original = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{original or ''} {TEST_XLA_FLAGS}".strip()
    import jax

    if os.environ.get(SERVERS_ON) == "tpu":  # the chip is for the servers this run starts: none here
        jax.config.update("jax_platforms", "cpu")  # not JAX_PLATFORMS, which the servers would inherit
    jax.devices()
    if jax.default_backend() == "tpu":
        # float32 references at float32 (a TPU multiplies float32 in one bfloat16 pass by default); the engines
        # under test trace their steps at EngineConfig.matmul_precision (auto: highest for float32) anyway
        jax.config.update("jax_default_matmul_precision", "highest")
    if original is None:
        del os.environ["XLA_FLAGS"]
    else:
        os.environ["XLA_FLAGS"] = original

    path = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="loraserve-xla-cache-"))
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    enable_compilation_cache(path)


# The longest test files, longest first (their tests' seconds, setup included, averaged over two --durations runs
# of `make test`'s selection on a 2-core Zen 4, 2026-12-07: ~1630 s of tests in ~830 s on two processes):
# `make test` hands whole files to its processes in collection order, so these go first and the run
# does not end with one process alone on a long file that started last. Update when the durations move.
LONGEST_FILES = (
    "tests/bench/test_bench_smoke.py",
    "tests/worker/test_tensor_parallel.py",
    "tests/bench/test_device_scripts.py",
    "tests/e2e/test_multihost.py",
    "tests/worker/test_quantization.py",
    "tests/worker/test_tensor_parallel_families.py",
    "tests/worker/test_moe.py",
    "tests/worker/test_embed_lora.py",
    "tests/worker/test_moe_lora.py",
    "tests/worker/test_lora_parity.py",
    "tests/e2e/test_system.py",
    "tests/worker/test_dora_worker.py",
    "tests/worker/test_paged_engine.py",
    "tests/e2e/test_load.py",
    "tests/worker/test_engine.py",
    "tests/kernels/test_linear_quant.py",
    "tests/e2e/test_demo.py",
    "tests/worker/test_shard_reads.py",
    "tests/kernels/test_pallas.py",
    "tests/kernels/test_paged_attention.py",
    "tests/worker/test_model_parity.py",
    "tests/worker/test_families.py",
    "tests/kernels/test_xla.py",
    "tests/e2e/test_llmd_conformance.py",
    "tests/router/test_inplace_update.py",
)


def _longest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the files of :data:`LONGEST_FILES` first (in that order), then the rest as
    collected; a file's own tests keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    root = Path(__file__).resolve().parent.parent

    def key(item: pytest.Item) -> int:
        path = Path(str(item.path)).resolve()
        name = path.relative_to(root).as_posix() if path.is_relative_to(root) else ""
        return rank.get(name, len(rank))

    items.sort(key=key)  # stable: collection order within a file and among the rest


# How a file marks `exclusive` tests, as the Makefile's EXCLUSIVE_FILES greps for it: `make test`'s exclusive
# run reads only the files that match (a test marked another way would be run by neither of its two runs).
EXCLUSIVE_MARK = r"mark\.exclusive\b"


def _check_exclusive_files(items: list[pytest.Item]) -> None:
    """A usage error when an ``exclusive`` test's file does not match :data:`EXCLUSIVE_MARK`."""
    files = {Path(item.path) for item in items if item.get_closest_marker("exclusive")}
    unmarked = {str(path) for path in files if not re.search(EXCLUSIVE_MARK, path.read_text())}
    if unmarked:
        raise pytest.UsageError(
            f"{sorted(unmarked)} mark tests exclusive in a way the Makefile's grep ({EXCLUSIVE_MARK}) "
            "does not find: write `pytest.mark.exclusive` in the file"
        )


def _platform_marks(items: list[pytest.Item]) -> None:
    """``cpu_only(reason)`` tests are skipped on a TPU with their reason shown (``make test-tpu`` lists the
    skips: none is silent); ``tpu`` tests elsewhere unless :data:`SERVERS_ON` says where their servers run."""
    import jax

    on_tpu = jax.default_backend() == "tpu"
    servers_on = os.environ.get(SERVERS_ON, "")
    if servers_on not in ("", "tpu", "cpu"):
        raise pytest.UsageError(f"{SERVERS_ON} must be tpu or cpu, got {servers_on!r}")
    for item in items:
        cpu_only = item.get_closest_marker("cpu_only")
        if cpu_only is not None:
            if not cpu_only.args or not str(cpu_only.args[0]).strip():
                raise pytest.UsageError(f"{item.nodeid}: pytest.mark.cpu_only needs its reason")
            if on_tpu:
                item.add_marker(pytest.mark.skip(reason=f"CPU-only: {cpu_only.args[0]}"))
        if item.get_closest_marker("tpu") is not None and not (on_tpu or servers_on):
            item.add_marker(pytest.mark.skip(reason=f"needs a TPU ({SERVERS_ON}=cpu runs it on this CPU)"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_first(items)
    _check_exclusive_files(items)
    _platform_marks(items)
    if os.environ.get(POSTGRES_ENV):
        return
    skip = pytest.mark.skip(reason=f"{POSTGRES_ENV} is not set: no PostgreSQL server to test against")
    for item in items:
        if "postgres" in item.keywords:
            item.add_marker(skip)


def _with_database(url: str, database: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=database).render_as_string(hide_password=False)


@contextlib.contextmanager
def fresh_postgres_database(base_url: str) -> Iterator[str]:
    """A brand-new PostgreSQL database on ``base_url``'s server (its URL), dropped on leaving."""
    from sqlalchemy import create_engine, text

    name = f"loraserve_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    try:
        with admin.connect() as conn:  # an unreachable server raises here: the test fails, never skips
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield _with_database(base_url, name)
    finally:
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            admin.dispose()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """SQLAlchemy URL of a brand-new PostgreSQL database, dropped after the test."""
    base_url = os.environ.get(POSTGRES_ENV)
    if not base_url:
        pytest.skip(f"{POSTGRES_ENV} is not set")
    with fresh_postgres_database(base_url) as url:
        yield url


# ---------------------------------------------------------------- tiny models and PEFT adapters

FAMILIES = {
    # llama3 rope scaling, untied head
    "llama": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    ),
    "mistral": dict(),
    # qkv bias (always on for qwen2) and tied embeddings
    "qwen2": dict(tie_word_embeddings=True),
    # the new families: their distinctive settings (windows, soft caps, RoPE tables) are in testing.TINY
    "qwen3": dict(),
    "gemma2": dict(),
    "gemma3_text": dict(),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        name: save_model(root / name, name, seed=i, **kw) for i, (name, kw) in enumerate(FAMILIES.items())
    }


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


# name -> make_adapter kwargs: different ranks, alphas, rsLoRA and target subsets.
ADAPTERS = {
    "all-r4": dict(r=4, alpha=8.0, seed=1),
    "qv-r8-rslora": dict(r=8, alpha=4.0, use_rslora=True, targets=("q_proj", "v_proj"), seed=2),
    "mlp-r16": dict(r=16, alpha=32.0, targets=("gate_proj", "up_proj", "down_proj"), seed=3),
    "attn-pattern": dict(
        r=8,
        alpha=8.0,
        targets=("q_proj", "k_proj", "o_proj"),
        rank_pattern={"k_proj": 2},
        alpha_pattern={"o_proj": 3.0},
        seed=4,
    ),
}


@pytest.fixture(scope="session")
def adapter_dirs(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, kw in ADAPTERS.items():
        base = AutoModelForCausalLM.from_pretrained(str(llama_dir))
        make_adapter(base, root / name, **kw)
        out[name] = root / name
    return out


def _adapters_per_family(model_dirs, tmp_path_factory, prefix: str, specs: dict[str, dict]):
    """``get(family) -> {name -> folder}``: ``specs`` made with peft on that family's base, on first use."""
    from transformers import AutoModelForCausalLM

    made: dict[str, dict[str, Path]] = {}

    def get(family: str) -> dict[str, Path]:
        if family not in made:
            root = tmp_path_factory.mktemp(f"{prefix}-{family}")
            for name, kw in specs.items():
                make_adapter(AutoModelForCausalLM.from_pretrained(str(model_dirs[family])), root / name, **kw)
            made[family] = {name: root / name for name in specs}
        return made[family]

    return get


@pytest.fixture(scope="session")
def family_adapter_dirs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """``family -> {adapter name -> folder}``: the ADAPTERS made on that family's base, built on first use."""
    return _adapters_per_family(model_dirs, tmp_path_factory, "adapters", ADAPTERS)


# name -> make_adapter kwargs of the DoRA / lora_bias tests (tests/worker/test_dora*.py); the plain one is
# "all-r4" above
DORA_ADAPTERS = {
    "dora-all-r4": dict(r=4, alpha=8.0, use_dora=True, seed=11),
    "dora-pattern-rslora": dict(
        r=8,
        alpha=4.0,
        use_rslora=True,
        use_dora=True,
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"),
        rank_pattern={"k_proj": 2},
        alpha_pattern={"o_proj": 3.0},
        seed=12,
    ),
    "bias-r4": dict(r=4, alpha=8.0, lora_bias=True, seed=13),
    "plain-r4": ADAPTERS["all-r4"],
}


@pytest.fixture(scope="session")
def dora_dirs(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """``family -> {name -> folder}`` of DORA_ADAPTERS made on that family's base, built on first use."""
    return _adapters_per_family(model_dirs, tmp_path_factory, "dora", DORA_ADAPTERS)
