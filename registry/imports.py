"""Where ``ImportAdapter`` may read from: only URL prefixes an admin allowed (``--import-allow``).

Without a rule, ``ImportAdapter`` would make the registry fetch any URL it can reach: internal HTTP services,
cloud metadata endpoints, local folders with secrets. So every import URL must sit under an allowed prefix
(default: the registry's own storage root and nothing else), or it is refused with PERMISSION_DENIED naming
the rule. The check is done on what is really read, not on the string the caller sent:

- local paths (plain or ``file://``): the folder and each file are resolved with ``realpath`` (``..`` and
  symlinks followed) and must stay inside an allowed folder — a symlink out of it is refused;
- ``http(s)://``: fetched here with urllib, redirects followed one by one only while each target is itself
  under an allowed prefix; any other redirect is refused;
- other fsspec protocols (``gs://``, ``s3://``, ``memory://``): the normalised URL must start with an allowed
  prefix and may not contain ``..`` segments.
"""

from __future__ import annotations

import os
import posixpath
import urllib.error
import urllib.request
from collections.abc import Sequence
from urllib.parse import urljoin

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.files import CONFIG_FILE, WEIGHTS_FILE, read_adapter_files
from loraserve.common.errors import InvalidArgument, PermissionDenied

RULE = "--import-allow (LORASERVE_REGISTRY_IMPORT_ALLOW)"
MAX_REDIRECTS = 5


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _local_path(url: str) -> str:
    return os.path.realpath(url.removeprefix("file://"))


def _remote(url: str) -> str:
    """``proto://a/b/./c`` -> ``proto://a/b/c``; ``..`` segments are refused outright (no guessing)."""
    proto, _, rest = url.partition("://")
    if ".." in rest.split("/"):
        raise PermissionDenied(f"import URL {url[:200]!r} contains '..': refused by {RULE}")
    return f"{proto.lower()}://{posixpath.normpath(rest) if rest else ''}"


def _under(path: str, prefix: str) -> bool:
    return path == prefix.rstrip("/") or path.startswith(prefix.rstrip("/") + "/")


class ImportPolicy:
    """The allowed prefixes, normalised once; ``read(url)`` returns the adapter files or refuses."""

    def __init__(self, allow: Sequence[str], storage_root: str, max_bytes: int = 1 << 30) -> None:
        prefixes = [a.strip() for a in allow if a.strip()] or [storage_root]
        self.local = [_local_path(p) for p in prefixes if _is_local(p)]
        self.remote = [_remote(p) for p in prefixes if not _is_local(p)]
        self.max_bytes = max_bytes

    def describe(self) -> str:
        return ", ".join(self.local + self.remote) or "nothing"

    def _deny(self, url: str) -> PermissionDenied:
        return PermissionDenied(
            f"importing from {url[:200]!r} is not allowed: {RULE} allows only {self.describe()}"
        )

    def read(self, url: str) -> tuple[bytes, bytes]:
        """``(adapter_config.json, adapter_model.safetensors)`` bytes from an allowed place."""
        if not url:
            raise InvalidArgument("uri is empty")
        if _is_local(url):
            return self._read_local(url)
        scheme = url.partition("://")[0].lower()
        if scheme in ("http", "https"):
            return self._read_http(url)
        normal = _remote(url)
        if not any(_under(normal, p) for p in self.remote):
            raise self._deny(url)
        return read_adapter_files(normal)

    def _read_local(self, url: str) -> tuple[bytes, bytes]:
        folder = _local_path(url)
        allowed = [p for p in self.local if _under(folder, p)]
        if not allowed:
            raise self._deny(url)
        for name in (CONFIG_FILE, WEIGHTS_FILE):  # a file may itself be a symlink out of the folder
            real = os.path.realpath(os.path.join(folder, name))
            if os.path.exists(real) and not any(_under(real, p) for p in allowed):
                raise PermissionDenied(
                    f"{name} in {url[:200]!r} links outside the allowed folder: refused by {RULE}"
                )
        return read_adapter_files(folder)

    def _read_http(self, url: str) -> tuple[bytes, bytes]:
        base = _remote(url)
        if not any(_under(base, p) for p in self.remote):
            raise self._deny(url)
        return self._get(f"{base}/{CONFIG_FILE}"), self._get(f"{base}/{WEIGHTS_FILE}")

    def _get(self, url: str) -> bytes:
        opener = urllib.request.build_opener(_NoRedirect)
        for _ in range(MAX_REDIRECTS + 1):
            try:
                with opener.open(url, timeout=30) as resp:
                    data = resp.read(self.max_bytes + 1)
                if len(data) > self.max_bytes:
                    raise InvalidArgument(
                        f"{url[:200]} is larger than the upload limit of {self.max_bytes} bytes"
                    )
                return data
            except urllib.error.HTTPError as exc:
                if exc.code in (301, 302, 303, 307, 308) and exc.headers.get("Location"):
                    target = urljoin(url, exc.headers["Location"])
                    if not any(_under(target, p) for p in self.remote):
                        raise PermissionDenied(
                            f"{url[:200]} redirects to {target[:200]!r}, outside what {RULE} allows"
                        ) from None
                    url = target
                    continue
                raise AdapterError(f"cannot read {url[:200]}: HTTP {exc.code}") from None
            except (urllib.error.URLError, OSError) as exc:
                raise AdapterError(f"cannot read {url[:200]}: {exc}") from None
        raise AdapterError(f"{url[:200]}: more than {MAX_REDIRECTS} redirects")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects come back as HTTPError so ``_get`` checks every target against the rule."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None
