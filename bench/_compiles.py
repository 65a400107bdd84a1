"""The XLA compilations of this process and their seconds, from JAX's monitoring events.

On an accelerator a benchmark's time goes mostly to compiling (a 3B-shaped engine's step, unrolled over its
layers, is one large program per shape), so the benches report it beside what they time: the numbers that
size a device session's budget (``bench/tpu_session.sh bench``). Programs read from the persistent
compilation cache are not compiled and not counted.
"""

from __future__ import annotations

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
_totals = {"count": 0, "seconds": 0.0, "longest": 0.0}
_started = False


def _listen(event: str, duration: float, **_: object) -> None:
    if event == BACKEND_COMPILE:
        _totals["count"] += 1
        _totals["seconds"] += duration
        _totals["longest"] = max(_totals["longest"], duration)


def start() -> None:
    """Count from now on (once per process)."""
    global _started
    if not _started:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_listen)
        _started = True


def totals() -> dict[str, float]:
    """{"count": compilations, "seconds": their sum, "longest": the longest one's} so far."""
    return {
        "count": int(_totals["count"]),
        "seconds": round(_totals["seconds"], 1),
        "longest": round(_totals["longest"], 1),
    }
