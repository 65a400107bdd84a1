"""The worker's HTTP backend: requests go through the same servicer as gRPC ``Generate``; ``/v1/models`` lists
the base model and the adapters this worker knows (resident in a slot, or registered with its local source)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from loraserve.adapters.refs import split_ref
from loraserve.httpapi.schemas import adapter_for_model, model_card
from loraserve.httpapi.server import CallContext
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.worker.server import InferenceServicer


class WorkerHttpBackend:
    role = "worker"

    def __init__(self, servicer: InferenceServicer, model_id: str, model_path: str = "") -> None:
        self.servicer, self.model_id = servicer, model_id
        self.base_ids = {model_id} | ({model_path} if model_path else set())
        self.started = int(time.time())

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
