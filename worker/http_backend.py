"""The worker's HTTP backend: requests go through the same servicer as gRPC ``Generate``; ``/v1/models`` lists
the base model and the adapters this worker knows (resident in a slot, or registered with its local source);
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's runtime LoRA API) load and free slots as the
``WorkerAdmin`` RPCs do, with their tokens.

A ``lora_path`` is accepted only by a worker serving local adapters (one with a registry loads what the
registry holds, by name) and only under one of its ``--lora-import-prefixes``: a local folder must resolve
(symlinks followed) inside a prefix folder, a URL must start with a prefix on a whole path segment and hold
no ``..`` segment. Anything else is PERMISSION_DENIED, and nothing is registered or loaded."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from loraserve.adapters.refs import split_ref
from loraserve.adapters.sources import LocalAdapterSource
from loraserve.common.errors import FailedPrecondition, PermissionDenied
from loraserve.common.limits import check_ref
from loraserve.httpapi.schemas import adapter_for_model, model_card
from loraserve.httpapi.server import CallContext
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.worker.server import InferenceServicer


class WorkerHttpBackend:
    role = "worker"

    # how long an unload waits for the requests using the adapter to finish
    UNLOAD_WAIT_S = 30.0

    def __init__(
        self,
        servicer: InferenceServicer,
        model_id: str,
        model_path: str = "",
        import_prefixes: Sequence[str] = (),
    ) -> None:
        self.servicer, self.model_id = servicer, model_id
        self.import_prefixes = tuple(import_prefixes)
        self.base_ids = {model_id} | ({model_path} if model_path else set())
        self.started = int(time.time())

    def refusal(self):
        """Admission at the HTTP edge (``httpapi.app.Edge``): a full queue, before the body is read."""
        return self.servicer.engine.refusal() if self.servicer.engine.ready.is_set() else None

    async def adapter_for(self, model: str) -> str:
        return adapter_for_model(model, self.base_ids)

    def generate(
        self, request: pb.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        return self.servicer.Generate(request, CallContext(timeout))

    async def models(self) -> list[dict[str, Any]]:
        engine = self.servicer.engine
        cards = [model_card(self.model_id, self.started, "loraserve")]
        names: dict[str, str] = {}  # adapter name -> root ("name@3" when resident)
        for name in getattr(engine.source, "known", lambda: [])():
            names.setdefault(split_ref(name)[0], name)
        for slot in engine.snapshot().slots:
            if slot.adapter:
                names[split_ref(slot.adapter)[0]] = slot.adapter
        for name, root in sorted(names.items()):
            cards.append(model_card(name, self.started, "loraserve", parent=self.model_id, root=root))
        return cards

    async def load_lora(self, name: str, path: str) -> None:
        """``name`` into a slot (from ``path`` when given: module doc); NOT_FOUND for an unknown name."""
        check_ref(name)
        engine = self.servicer.engine
        if path:
            if not isinstance(engine.source, LocalAdapterSource):
                raise PermissionDenied(
                    "this worker loads adapters from its registry: import the folder there (loraserve adapters"
                    " import) and load it by name, without lora_path"
                )
            if not _under(path, self.import_prefixes):
                allowed = ", ".join(self.import_prefixes) or "none: set --lora-import-prefixes"
                raise PermissionDenied(f"lora_path {path[:200]!r} is not under an allowed prefix ({allowed})")
            engine.source.register(name, path)
        await asyncio.wrap_future(engine.load_adapter(name, False))

    async def unload_lora(self, name: str) -> None:
        """Free ``name``'s slot once the requests using it have finished (at most UNLOAD_WAIT_S)."""
        check_ref(name)
        deadline = time.monotonic() + self.UNLOAD_WAIT_S
        while True:
            try:
                await asyncio.wrap_future(self.servicer.engine.unload_adapter(name, False))
                return
            except FailedPrecondition:  # in use: its requests finish first
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)


def _under(path: str, prefixes: Sequence[str]) -> bool:
    """Whether ``path`` lies inside one of ``prefixes`` (module doc)."""
    if "://" in path or "::" in path:
        if "::" in path or ".." in path.split("/"):
            return False
        return any(
            path == p.rstrip("/") or path.startswith(p.rstrip("/") + "/") for p in prefixes if "://" in p
        )
    real = os.path.realpath(path)
    for p in prefixes:
        if "://" in p:
            continue
        root = os.path.realpath(p)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return True
    return False
