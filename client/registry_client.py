"""``RegistryClient``: push, list, inspect, download and delete adapters; list workers (sync gRPC)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc

from loraserve.adapters.files import CONFIG_FILE, WEIGHTS_FILE, read_adapter_files
from loraserve.common.errors import DataLoss, error_from_rpc
from loraserve.common.security import channel as make_channel
from loraserve.protos.v1 import placement_pb2, placement_pb2_grpc, registry_pb2, registry_pb2_grpc

CHUNK = 1 << 20
Progress = Callable[[int, int], None]  # (bytes sent, total bytes)


class RegistryClient:
    def __init__(
        self,
        target: str,
        timeout: float = 60.0,
        channel: grpc.Channel | None = None,
        *,
        token: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
    ) -> None:
        self.channel = channel or make_channel(
            target, token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        self.timeout = timeout
        self.adapters = registry_pb2_grpc.AdapterRegistryStub(self.channel)
        self.placement = placement_pb2_grpc.PlacementStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, timeout=self.timeout, **kwargs)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def push(
        self,
        folder: str | Path,
        name: str,
        base_model: str,
        *,
        description: str = "",
        labels: dict[str, str] | None = None,
        version: int = 0,
        progress: Progress | None = None,
        chunk_size: int = CHUNK,
        allow_base_mismatch: bool = False,
    ) -> registry_pb2.Adapter:
        """Upload a PEFT folder (adapter_config.json + adapter_model.safetensors) as ``name``; the answer's
        ``warnings`` say what the registry accepted but could not check."""
        config, weights = read_adapter_files(str(folder))
        header = registry_pb2.UploadHeader(
            name=name,
            base_model=base_model,
            description=description,
            labels=labels or {},
            adapter_config_json=config,
            weights_size=len(weights),
            weights_sha256=hashlib.sha256(weights).hexdigest(),
            version=version,
            allow_base_mismatch=allow_base_mismatch,
        )

        def messages() -> Iterator[registry_pb2.UploadAdapterRequest]:
            yield registry_pb2.UploadAdapterRequest(header=header)
            for start in range(0, len(weights), chunk_size):
                yield registry_pb2.UploadAdapterRequest(chunk=weights[start : start + chunk_size])
                if progress is not None:
                    progress(min(start + chunk_size, len(weights)), len(weights))

        return self._call(self.adapters.UploadAdapter, messages())

    def import_uri(self, uri: str, name: str, base_model: str, **kw) -> registry_pb2.Adapter:
        return self._call(
            self.adapters.ImportAdapter,
            registry_pb2.ImportAdapterRequest(uri=uri, name=name, base_model=base_model, **kw),
        )

    def set_base_model_aliases(
        self, model_id: str, add: Sequence[str] = (), remove: Sequence[str] = ()
    ) -> registry_pb2.BaseModel:
        request = registry_pb2.SetBaseModelAliasesRequest(id=model_id, add=list(add), remove=list(remove))
        return self._call(self.adapters.SetBaseModelAliases, request)

    def stats(self, name: str) -> placement_pb2.AdapterStats:
        return self._call(self.placement.GetAdapterStats, placement_pb2.GetAdapterStatsRequest(name=name))

    def base_model(self, model_id: str) -> registry_pb2.BaseModel:
        return self._call(self.adapters.GetBaseModel, registry_pb2.GetBaseModelRequest(id=model_id))

    def get(self, ref: str, routing_key: str = "") -> registry_pb2.Adapter:
        return self._call(
            self.adapters.GetAdapter, registry_pb2.GetAdapterRequest(adapter=ref, routing_key=routing_key)
        )

    def set_alias(
        self, name: str, alias: str, targets: Sequence[tuple[int, float]], actor: str = ""
    ) -> registry_pb2.Alias:
        """Point ``name@alias`` at one version ``[(3, 1)]`` or a weighted split ``[(3, 90), (4, 10)]``."""
        request = registry_pb2.SetAliasRequest(
            name=name,
            alias=alias,
            targets=[registry_pb2.AliasTarget(version=v, weight=w) for v, w in targets],
            actor=actor,
        )
        return self._call(self.adapters.SetAlias, request)

    def delete_alias(self, name: str, alias: str, actor: str = "") -> registry_pb2.Alias:
        return self._call(
            self.adapters.DeleteAlias, registry_pb2.DeleteAliasRequest(name=name, alias=alias, actor=actor)
        )

    def alias_history(self, name: str, alias: str = "") -> list[registry_pb2.AliasChange]:
        request = registry_pb2.ListAliasHistoryRequest(name=name, alias=alias)
        return list(self._call(self.adapters.ListAliasHistory, request).changes)

    def set_running_limit(
        self,
        max_running: int,
        *,
        adapter: str = "",
        tenant: str = "",
        actor: str = "",
    ) -> registry_pb2.RunningLimit:
        """Cap the requests of one adapter name (every version), or of one tenant (adapters labelled
        ``tenant=T``), that each worker runs at once."""
        request = registry_pb2.SetRunningLimitRequest(
            adapter=adapter, tenant=tenant, max_running=max_running, actor=actor
        )
        return self._call(self.adapters.SetRunningLimit, request)

    def clear_running_limit(
        self, *, adapter: str = "", tenant: str = "", actor: str = ""
    ) -> registry_pb2.RunningLimit:
        request = registry_pb2.SetRunningLimitRequest(adapter=adapter, tenant=tenant, clear=True, actor=actor)
        return self._call(self.adapters.SetRunningLimit, request)

    def running_limits(self) -> list[registry_pb2.RunningLimit]:
        request = registry_pb2.ListRunningLimitsRequest()
        return list(self._call(self.adapters.ListRunningLimits, request).limits)

    def list(
        self, *, base_model: str = "", name_prefix: str = "", page_size: int = 100
    ) -> Iterator[registry_pb2.Adapter]:
        """Every matching adapter, following page tokens."""
        token = ""
        while True:
            page = self._call(
                self.adapters.ListAdapters,
                registry_pb2.ListAdaptersRequest(
                    page_size=page_size, page_token=token, base_model=base_model, name_prefix=name_prefix
                ),
            )
            yield from page.adapters
            token = page.next_page_token
            if not token:
                return

    def delete(self, ref: str) -> registry_pb2.DeleteAdapterResponse:
        return self._call(self.adapters.DeleteAdapter, registry_pb2.DeleteAdapterRequest(adapter=ref))

    def download(self, ref: str, dest: str | Path) -> registry_pb2.Adapter:
        """Write the adapter's PEFT files into ``dest``. The weights stream to a hidden partial file a chunk
        at a time (never held in memory whole) and take their name only once their sha256 matched; a
        mismatch or a failed stream leaves neither file."""
        dest = Path(dest)
        partial = dest / f".{WEIGHTS_FILE}.partial"
        header, digest, out = None, hashlib.sha256(), None
        try:
            stream = self.adapters.DownloadAdapter(
                registry_pb2.DownloadAdapterRequest(adapter=ref), timeout=self.timeout
            )
            for msg in stream:
                if msg.WhichOneof("payload") == "header":
                    header = msg.header
                    dest.mkdir(parents=True, exist_ok=True)
                    out = open(partial, "wb")  # noqa: SIM115 - closed below, whatever happens
                elif out is not None:
                    digest.update(msg.chunk)
                    out.write(msg.chunk)
            if out is not None:
                out.close()
            if header is None or digest.hexdigest() != header.adapter.sha256:
                raise DataLoss(f"download of {ref} does not match its sha256")
            (dest / CONFIG_FILE).write_bytes(header.adapter_config_json)
            os.replace(partial, dest / WEIGHTS_FILE)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            if out is not None:
                out.close()
                partial.unlink(missing_ok=True)
        return header.adapter

    def workers(self, *, model_id: str = "", include_expired: bool = False) -> list[placement_pb2.Worker]:
        resp = self._call(
            self.placement.ListWorkers,
            placement_pb2.ListWorkersRequest(model_id=model_id, include_expired=include_expired),
        )
        return list(resp.workers)

    def locate(self, ref: str, max_candidates: int = 0) -> placement_pb2.LocateAdapterResponse:
        return self._call(
            self.placement.LocateAdapter,
            placement_pb2.LocateAdapterRequest(adapter=ref, max_candidates=max_candidates),
        )
