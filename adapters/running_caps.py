"""Running caps as the worker applies them: how many requests of one adapter name, and of its tenant, a
worker runs at once (set in the registry: ``loraserve adapters limits``, registry.running_limits).

``RunningCaps`` is the worker's copy: heartbeat replies set the caps of every adapter name the worker
reported holding, GetAdapter answers set one name's as the worker resolves it. It is written on the registration
loop's and the loaders' threads and read by the scheduler on the engine thread: every write swaps in a new
dict, so a reader sees one consistent table without a lock.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.mixes import is_mix, parse_mix
from loraserve.adapters.refs import parse_ref
from loraserve.common.errors import LoraserveError

TENANT_LABEL = "tenant"  # the adapter label that names its tenant


@dataclass(frozen=True)
class Cap:
    """The caps on one adapter name (0 = none)."""

    max_running: int = 0
    tenant: str = ""  # the adapter's "tenant" label; "" = none
    tenant_max_running: int = 0

    def __bool__(self) -> bool:
        return bool(self.max_running or self.tenant_max_running)


class RunningCaps:
    def __init__(self, caps: Mapping[str, Cap] | None = None) -> None:
        self._caps: dict[str, Cap] = {n: c for n, c in (caps or {}).items() if c}

    def replace(self, caps: Mapping[str, Cap], covered: Iterable[str] | None = None) -> None:
        """The registry's answer for the names in ``covered`` (None: every name): they get exactly its caps
        (none when it gave none); other names keep theirs (e.g. one resolved since the heartbeat left)."""
        if covered is None:
            self._caps = {n: c for n, c in caps.items() if c}
            return
        kept = {n: c for n, c in self._caps.items() if n not in set(covered)}
        self._caps = kept | {n: c for n, c in caps.items() if c}

    def note(self, name: str, cap: Cap) -> None:
        """One name's caps, as GetAdapter gave them (no caps: forget the name's)."""
        caps = dict(self._caps)
        if cap:
            caps[name] = cap
        else:
            caps.pop(name, None)
        self._caps = caps

    def table(self) -> dict[str, Cap]:
        """The current table (never mutated: a write swaps in a new one)."""
        return self._caps


@functools.lru_cache(maxsize=4096)
def adapter_names(key: str) -> tuple[str, ...]:
    """The adapter names a request's resolved key counts against: ``name@3`` -> ``name``; a weighted mix
    counts against each of its parts; a local path or the base, nothing."""
    try:
        if is_mix(key):
            return tuple(sorted({parse_ref(p.ref).name for p in parse_mix(key)}))
        return (parse_ref(key).name,)
    except (AdapterError, LoraserveError, ValueError):
        return ()
