"""What the tests run on, a CPU (`make test`, CI) or a TPU (`make test-tpu`), and what differs between them.

The process's JAX backend is decided before collection (tests/conftest.py opens it), so these are constants.
On a TPU the C++ CPU kernels (XLA:CPU custom calls) cannot run inside a TPU program: a test that names the
``cpu`` LoRA backend as "the fast one" takes :data:`NATIVE_BACKEND` (the Pallas kernels there), and a test
of the C++ kernels themselves is ``cpu_only``.
"""

from __future__ import annotations

import os

import jax
import pytest

from tests.conftest import SERVERS_ON

ON_TPU = jax.default_backend() == "tpu"
# where the servers a test starts as processes run: the chip in tests/tpu.sh's second run (conftest.SERVERS_ON)
SERVERS_ON_TPU = ON_TPU or os.environ.get(SERVERS_ON) == "tpu"
# the platform's own multi-LoRA backend: the C++ kernels on a CPU, the Pallas kernels compiled for a TPU
NATIVE_BACKEND = "pallas" if ON_TPU else "cpu"
CPP_KERNELS = "the C++ CPU kernels are XLA:CPU custom calls: a TPU program cannot call them"
SUBPROCESS_JAX = "starts a second JAX process while this one holds the chip (one process at a time can)"
INTERPRET = "runs Pallas' TPU interpret mode, the CPU's stand-in for the chip"
cpp_only = pytest.mark.cpu_only(CPP_KERNELS)


def backends(*names: str) -> list:
    """``names`` as parametrize values, ``cpu`` (the C++ kernels) marked ``cpu_only``."""
    return [pytest.param(n, marks=cpp_only) if n == "cpu" else n for n in names]
