"""``test_row_isolation.test_sharded_backends_keep_rows_isolated``'s runs, in a process of their own: JAX must
see two CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=2`` before it starts). For every
backend wrapped in ``ShardedBackend``, a decode batch and packed segments, column- and row-parallel, with the
poisoned slot healthy and poisoned; prints ``{"<backend>/<kind>": "isolated" | what differed}`` as JSON.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from loraserve import kernels
from loraserve.kernels.backends import COLUMN, ROW
from loraserve.kernels.sharded import AXIS, ShardedBackend
from tests.kernels.test_row_isolation import B_NAMES, IDX, POISONED, SEGMENTS, T, pools_of, problem


def _run(backend, parallel, pools, x, y, plan):
    seg = jnp.asarray(SEGMENTS, jnp.int32)

    def both(p, x, y, plan):
        a, bs = p["A_qkv"], [p[b] for b in B_NAMES]
        decode = backend.apply_decode(y, x, a, bs, plan, parallel)
        return decode, backend.apply_segments(y, x, a, bs, seg, parallel)

    return [np.asarray(out, np.float32) for out in jax.jit(both)(pools, x, y, plan)]


def main() -> None:
    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    x, y = problem(jnp.float32)
    idx = np.asarray(IDX["mixed"], np.int32)
    victims = idx != POISONED
    seg_victims = np.repeat(np.asarray(SEGMENTS) != POISONED, T // len(SEGMENTS))
    report = {}
    for name in kernels.LORA_BACKENDS:
        backend = ShardedBackend(kernels.get_backend(name), mesh)
        backend.check()
        plan = backend.plan(idx, 5)
        healthy, poisoned = pools_of(backend, jnp.float32, False), pools_of(backend, jnp.float32, True)
        for parallel in (COLUMN, ROW):
            (d0, s0), (d1, s1) = (_run(backend, parallel, p, x, y, plan) for p in (healthy, poisoned))
            ok = np.isfinite(d0).all() and np.array_equal(d0[victims], d1[victims])
            ok_seg = np.isfinite(s0).all() and np.array_equal(s0[seg_victims], s1[seg_victims])
            reached = not np.array_equal(d0[~victims], d1[~victims])
            isolated = ok and ok_seg and reached
            report[f"{name}/{parallel}"] = (
                "isolated" if isolated else f"decode {ok} segments {ok_seg} reached {reached}"
            )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
