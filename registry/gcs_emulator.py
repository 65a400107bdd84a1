"""Run the PyPI ``gcp-storage-emulator`` in-process on a free loopback port, for tests and local runs.

    with start_gcs_emulator("adapters") as emu:
        store = BlobStore("gs://adapters/prefix", **gcs_storage_options(emu.endpoint))

The emulator keeps everything in memory (no files are left behind) and answers on one thread. gcsfs must run
with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` against it (docs/design.md §3): :func:`start_gcs_emulator` sets that
default before gcsfs is imported, otherwise every bucket probe waits 60 s on a gRPC call the emulator cannot
answer.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def gcs_storage_options(endpoint: str) -> dict[str, Any]:
    """gcsfs keyword arguments for an emulator at ``endpoint`` (``http://127.0.0.1:PORT``)."""
    return {"endpoint_url": endpoint, "token": "anon", "project": "loraserve-test"}


class GcsEmulator:
    """A running in-memory emulator: ``endpoint``, ``bucket``, ``stop()``; also a context manager."""

    def __init__(self, server: Any, host: str, port: int, bucket: str) -> None:
        self._server = server
        self.host, self.port, self.bucket = host, port, bucket
        self.endpoint = f"http://{host}:{port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return gcs_storage_options(self.endpoint)

    def url(self, prefix: str = "") -> str:
        """``gs://<bucket>/<prefix>``."""
        return f"gs://{self.bucket}/{prefix}".rstrip("/")

    def wipe(self, keep_buckets: bool = True) -> None:
        self._server.wipe(keep_buckets=keep_buckets)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> GcsEmulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"GcsEmulator({self.endpoint!r}, bucket={self.bucket!r})"


def _quiet_disconnects(httpd: Any) -> None:
    """gcsfs cancels the losing half of its concurrent info() probes; the emulator would print each
    resulting BrokenPipeError as a traceback on stderr."""
    default = httpd.handle_error

    def handle_error(request: Any, client_address: Any) -> None:
        import sys

        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("gcs emulator: client %s went away", client_address)
        else:
            default(request, client_address)

    httpd.handle_error = handle_error


def start_gcs_emulator(bucket: str = "loraserve", *, host: str = "127.0.0.1", port: int = 0) -> GcsEmulator:
    """Start an in-memory emulator with ``bucket`` created, on ``port`` (0: a free one). Takes milliseconds."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    from gcp_storage_emulator.server import create_server

    server = create_server(host, port, in_memory=True, default_bucket=bucket)
    server.start()  # returns once the HTTP server is bound and serving
    try:
        httpd = server._api._httpd  # the package exposes no accessor for the bound port
        _quiet_disconnects(httpd)
        bound = httpd.server_address[1]
    except AttributeError as exc:
        server.stop()
        raise RuntimeError(
            "this gcp-storage-emulator version hides its HTTP server; pass an explicit port"
        ) from exc
    log.info("gcs emulator serving bucket %r on %s:%d", bucket, host, bound)
    return GcsEmulator(server, host, bound, bucket)
