"""Where ``ImportAdapter`` may read from: only URL prefixes an admin allowed (``--import-allow``).

Without a rule, ``ImportAdapter`` would make the registry fetch any URL it can reach: internal HTTP services,
cloud metadata endpoints, local folders with secrets. So every import URL must sit under an allowed prefix
(default: the registry's own storage root and nothing else), or it is refused with PERMISSION_DENIED naming
the rule. The check is made on what is really read, never on the string the caller sent:

- every URI: percent-encoding is decoded once (``file://`` and remote URLs; a plain path is taken as it is)
  and what is left may not hold another escape (double encoding), a backslash, a control character or an
  fsspec chain (``::``); a prefix matches on whole path segments only (``/allowed`` is not a prefix of
  ``/allowed-evil``);
- local paths (plain or ``file://``): the folder and each file are resolved with ``realpath`` (``..`` and
  symlinks followed) and must stay inside an allowed folder: a symlink out of it is refused; each file is
  opened without following a symlink and must be a regular file (no FIFO or device);
- ``http(s)://``: a ``..`` segment is refused, user info too; host and port must be an allowed prefix's (a
  prefix without a host, ``https://``, allows any); the host's addresses are resolved once and the
  connection is made to those very addresses, refused when one is loopback, private, link-local, reserved,
  multicast, unspecified or otherwise not global (IPv4-mapped, 6to4, NAT64 and Teredo IPv6 forms by their
  IPv4 address) unless an allowed prefix names that host explicitly; redirects are followed one by one, each
  target checked the same way; no proxy is used;
- other fsspec protocols (``gs://``, ``s3://``, ``memory://``): no ``..`` segment, under an allowed prefix.

Sizes are capped for every scheme while reading, never after: ``adapter_config.json`` at
``MAX_CONFIG_BYTES``, ``adapter_model.safetensors`` at the registry's ``--max-upload-bytes``
(RESOURCE_EXHAUSTED, as for an upload; a declared size over it is refused before the first byte).
"""

from __future__ import annotations

import errno
import http.client
import ipaddress
import os
import re
import socket
import ssl
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import quote, unquote, urljoin, urlsplit

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.files import CONFIG_FILE, PICKLE_FILES, WEIGHTS_FILE
from loraserve.common.errors import InvalidArgument, PermissionDenied, ResourceExhausted

RULE = "--import-allow (LORASERVE_REGISTRY_IMPORT_ALLOW)"
MAX_REDIRECTS = 5
MAX_URI_CHARS = 4096
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json (a PEFT config is a few KiB; patterns of 1024 keys fit)
CHUNK = 1 << 20
SOCKET_TIMEOUT_S = 30.0  # each connect, send and receive
READ_TIMEOUT_S = 900.0  # one file, from the request to its last byte
ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
HOST = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
DEFAULT_PORTS = {"http": 80, "https": 443}
Sink = Callable[[bytes], object]  # takes the weights chunk by chunk (``ImportPolicy.read``)


def _is_local(url: str) -> bool:
    return "://" not in url or url.lower().startswith("file://")


def _deny(url: str, why: str) -> PermissionDenied:
    return PermissionDenied(f"import URI {url[:200]!r} {why}: refused by {RULE}")


def _decode_once(url: str, text: str) -> str:
    """``text`` percent-decoded once; refused when it still holds an escape (double encoding: a server that
    decodes again would see what the check did not)."""
    try:
        decoded = unquote(text, errors="strict") if "%" in text else text
    except UnicodeDecodeError:
        raise InvalidArgument(f"import URI {url[:200]!r}: a percent escape that is not UTF-8") from None
    if ESCAPE.search(decoded):
        raise _deny(url, "is percent-encoded twice")
    return decoded


def _check_chars(url: str, text: str) -> None:
    if CONTROL.search(text):
        raise InvalidArgument(f"import URI {url[:200]!r} holds a control character")
    if "\\" in text:
        raise _deny(url, "holds a backslash")


def _segments(url: str, path: str) -> tuple[str, ...]:
    """A decoded path's segments, ``.`` and empty ones dropped; a ``..`` segment is refused (no guessing what
    the other side resolves it against)."""
    parts = tuple(s for s in path.split("/") if s not in ("", "."))
    if ".." in parts:
        raise _deny(url, "contains '..'")
    return parts


def _under(path: tuple[str, ...], prefix: tuple[str, ...]) -> bool:
    return path[: len(prefix)] == prefix


def _local_path(url: str) -> str:
    """The real path a local URI names: ``file://`` URLs percent-decoded once, plain paths as they are (a plain
    path holding an escape is refused: ``%2e%2e`` means nothing to the file system, but is a traversal to
    anything that decodes it)."""
    if url.lower().startswith("file://"):
        rest = url[len("file://") :]
        if not rest.startswith("/"):
            host, _, rest = rest.partition("/")
            if host.lower() != "localhost":
                raise InvalidArgument(f"import URI {url[:200]!r}: a file:// URL names no other host")
            rest = "/" + rest
        path = _decode_once(url, rest.split("?", 1)[0].split("#", 1)[0])
    else:
        if ESCAPE.search(url):
            raise _deny(url, "holds a percent escape (a local path is not decoded; use a file:// URL)")
        path = url
    _check_chars(url, path)
    return os.path.realpath(path)


def _path_parts(real: str) -> tuple[str, ...]:
    return tuple(s for s in real.split("/") if s)


@dataclass(frozen=True)
class _Url:
    """An http(s) URL, normalised: what is requested is what was checked."""

    scheme: str
    host: str  # lower case, no trailing dot; IPv6 without brackets; "" only in a prefix (any host)
    port: int
    path: tuple[str, ...]  # decoded segments
    query: str = ""

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"

    @property
    def target(self) -> str:
        """The request target: the path re-encoded (each segment quoted), then the query as it came."""
        path = "/" + "/".join(quote(s, safe="") for s in self.path)
        return path + (f"?{self.query}" if self.query else "")

    def __str__(self) -> str:
        return f"{self.scheme}://{self.netloc}{self.target}"

    def child(self, name: str) -> _Url:
        return _Url(self.scheme, self.host, self.port, (*self.path, name))


def _parse_http(url: str, prefix: bool = False) -> _Url:
    _check_chars(url, url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"import URI {url[:200]!r} is not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise _deny(url, "carries user info")
    host = _decode_once(url, parts.hostname or "").rstrip(".")
    if host and not HOST.match(host):
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            raise InvalidArgument(f"import URI {url[:200]!r}: {host[:100]!r} is not a host name") from None
    if not host and not prefix:
        raise InvalidArgument(f"import URI {url[:200]!r} names no host")
    if parts.fragment or (prefix and parts.query):
        raise InvalidArgument(f"import URI {url[:200]!r}: no query or fragment here")
    path = _segments(url, _decode_once(url, parts.path))
    return _Url(scheme, host, port or DEFAULT_PORTS[scheme], path, parts.query)


def _remote(url: str) -> tuple[str, tuple[str, ...]]:
    """An fsspec URL (``gs://bucket/a``) as (protocol, decoded segments); chains (``::``) are refused."""
    _check_chars(url, url)
    if "::" in url:
        raise _deny(url, "chains fsspec protocols ('::')")
    proto, _, rest = url.partition("://")
    return proto.lower(), _segments(url, _decode_once(url, rest))


def special_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """Why an address is no place for the registry to fetch from ("" when it is a global unicast one)."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in ipaddress.IPv6Network("64:ff9b::/96"):  # NAT64
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return special_address(embedded)
    for what in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved"):
        if getattr(ip, f"is_{what}"):
            return what.replace("_", "-")
    return "" if ip.is_global else "not global"


class ImportPolicy:
    """The allowed prefixes, normalised once; ``read(url)`` returns the adapter files or refuses."""

    def __init__(self, allow: Sequence[str], storage_root: str, max_bytes: int = 1 << 30) -> None:
        prefixes = [a.strip() for a in allow if a.strip()] or [storage_root]
        self.local: list[str] = []
        self.http: list[_Url] = []
        self.remote: list[tuple[str, tuple[str, ...]]] = []
        self._shown: list[str] = []
        for p in prefixes:
            if _is_local(p):
                self.local.append(_local_path(p))
                self._shown.append(self.local[-1])
            elif p.partition("://")[0].lower() in DEFAULT_PORTS:
                self.http.append(_parse_http(p, prefix=True))
                self._shown.append(p)
            else:
                self.remote.append(_remote(p))
                self._shown.append(p)
        self.max_bytes = max_bytes
        self.resolve: Callable[[str, int], list[str]] = _resolve  # tests may stub DNS

    def describe(self) -> str:
        return ", ".join(self._shown) or "nothing"

    def _not_allowed(self, url: str) -> PermissionDenied:
        return PermissionDenied(
            f"importing from {url[:200]!r} is not allowed: {RULE} allows only {self.describe()}"
        )

    def read(self, url: str, sink: Sink | None = None) -> tuple[bytes, bytes]:
        """``(adapter_config.json, adapter_model.safetensors)`` bytes from an allowed place. With ``sink``, the
        weights go to it chunk by chunk as they arrive (a refusal can come after some did: discard them)
        and ``b""`` comes back in their place."""
        if not url:
            raise InvalidArgument("uri is empty")
        if len(url) > MAX_URI_CHARS:
            raise InvalidArgument(f"uri is longer than {MAX_URI_CHARS} characters")
        if _is_local(url):
            return self._read_local(url, sink)
        if url.partition("://")[0].lower() in DEFAULT_PORTS:
            return self._read_http(url, sink)
        return self._read_fsspec(url, sink)

    def _limit(self, name: str) -> int:
        return MAX_CONFIG_BYTES if name == CONFIG_FILE else self.max_bytes

    def _too_big(self, url: str, name: str, size: int | None = None) -> ResourceExhausted:
        limit = self._limit(name)
        what = "--max-upload-bytes" if name == WEIGHTS_FILE else "the config limit"
        said = f" ({size} bytes)" if size is not None else ""
        return ResourceExhausted(f"{name} at {url[:200]}{said} is over {what} of {limit} bytes")

    def _collect(self, url: str, name: str, chunks: Iterator[bytes], sink: Sink | None = None) -> bytes:
        """Read ``chunks`` while counting: past the limit, stop and refuse; past ``READ_TIMEOUT_S``, give up.
        The bytes, or ``b""`` when each chunk went to ``sink``."""
        limit, parts, got = self._limit(name), [], 0
        deadline = time.monotonic() + READ_TIMEOUT_S
        for chunk in chunks:
            got += len(chunk)
            if got > limit:
                raise self._too_big(url, name)
            if time.monotonic() > deadline:
                raise AdapterError(f"reading {name} at {url[:200]} took longer than {READ_TIMEOUT_S:g} s")
            if sink is not None:
                sink(chunk)
            else:
                parts.append(chunk)
        return b"".join(parts)

    # ------------------------------------------------------------------ local folders
    def _read_local(self, url: str, sink: Sink | None) -> tuple[bytes, bytes]:
        folder = _local_path(url)
        allowed = [p for p in self.local if _under(_path_parts(folder), _path_parts(p))]
        if not allowed:
            raise self._not_allowed(url)
        if not os.path.isdir(folder):
            raise AdapterError(f"no adapter folder at {url}")
        real = {}
        for name in (WEIGHTS_FILE, CONFIG_FILE):  # a file may itself be a symlink out of the folder
            real[name] = os.path.realpath(os.path.join(folder, name))
            if not any(_under(_path_parts(real[name]), _path_parts(p)) for p in allowed):
                raise PermissionDenied(
                    f"{name} in {url[:200]!r} links outside the allowed folder: refused by {RULE}"
                )
        weights = self._read_local_file(url, WEIGHTS_FILE, real[WEIGHTS_FILE], folder, allowed, sink)
        return self._read_local_file(url, CONFIG_FILE, real[CONFIG_FILE], folder, allowed), weights

    def _read_local_file(
        self, url: str, name: str, real: str, folder: str, allowed: list[str], sink: Sink | None = None
    ) -> bytes:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(real, flags)  # no symlink swapped in since realpath; a FIFO does not block the open
        except FileNotFoundError:
            raise self._missing(url, name, lambda n: os.path.exists(os.path.join(folder, n))) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PermissionDenied(
                    f"{name} in {url[:200]!r} became a symlink: refused by {RULE}"
                ) from None
            raise AdapterError(f"cannot read {name} in {url}: {exc.strerror}") from None
        with os.fdopen(fd, "rb", buffering=0) as f:
            try:  # where the file opened really is (Linux): a folder on the way swapped for a link is seen
                opened = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                opened = real
            if not any(_under(_path_parts(opened), _path_parts(p)) for p in allowed):
                raise PermissionDenied(
                    f"{name} in {url[:200]!r} moved outside the allowed folder: refused by {RULE}"
                )
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise PermissionDenied(f"{name} in {url[:200]!r} is not a regular file: refused by {RULE}")
            if st.st_size > self._limit(name):
                raise self._too_big(url, name, st.st_size)
            return self._collect(url, name, _chunks(f), sink)

    @staticmethod
    def _missing(url: str, name: str, exists: Callable[[str], bool]) -> AdapterError:
        if name == WEIGHTS_FILE:
            pickled = [n for n in PICKLE_FILES if exists(n)]
            if pickled:
                return AdapterError(
                    f"{pickled[0]} is a pickle file, which is refused (loading it can run code)"
                )
        return AdapterError(f"no {name} in {url}")

    # ------------------------------------------------------------------ fsspec URLs
    def _read_fsspec(self, url: str, sink: Sink | None) -> tuple[bytes, bytes]:
        import fsspec

        proto, path = _remote(url)
        if not any(proto == p and _under(path, pp) for p, pp in self.remote):
            raise self._not_allowed(url)
        normal = f"{proto}://{'/'.join(path)}"
        try:
            fs, root = fsspec.core.url_to_fs(normal)
        except (ValueError, ImportError) as exc:
            raise AdapterError(f"cannot open {normal}: {exc}") from None
        root = root.rstrip("/")
        files = {}
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            try:
                size = fs.size(f"{root}/{name}")
                if size is not None and size > self._limit(name):
                    raise self._too_big(url, name, size)
                with fs.open(f"{root}/{name}", "rb") as f:
                    files[name] = self._collect(url, name, _chunks(f), sink if name == WEIGHTS_FILE else None)
            except FileNotFoundError:
                raise self._missing(url, name, lambda n: fs.exists(f"{root}/{n}")) from None
            except OSError as exc:
                raise AdapterError(f"cannot read {name} in {url}: {exc}") from None
        return files[CONFIG_FILE], files[WEIGHTS_FILE]

    # ------------------------------------------------------------------ http(s)
    def _check_http(self, url: str, came_from: str = "") -> tuple[_Url, list[str]]:
        """``url`` normalised, matched against the allowed prefixes, and the addresses to connect to."""
        try:
            parsed = _parse_http(url)
        except PermissionDenied as exc:
            if came_from:
                raise PermissionDenied(f"{came_from[:200]} redirects: {exc.message}") from None
            raise
        matches = [
            p
            for p in self.http
            if p.scheme == parsed.scheme
            and (not p.host or (p.host, p.port) == (parsed.host, parsed.port))
            and _under(parsed.path, p.path)
        ]
        if not matches:
            if came_from:
                raise PermissionDenied(
                    f"{came_from[:200]} redirects to {url[:200]!r}, outside what {RULE} allows"
                )
            raise self._not_allowed(url)
        addresses = self.resolve(parsed.host, parsed.port)
        if not any(p.host for p in matches):  # no prefix names this host: public addresses only
            for address in addresses:
                why = special_address(ipaddress.ip_address(address.split("%", 1)[0]))
                if why:
                    raise PermissionDenied(
                        f"import URL {url[:200]!r}: {parsed.host} resolves to {address}, a {why} address; "
                        f"refused by {RULE} unless a prefix names this host"
                    )
        return parsed, addresses

    def _read_http(self, url: str, sink: Sink | None) -> tuple[bytes, bytes]:
        base, _ = self._check_http(url)
        if base.query:
            raise InvalidArgument(f"import URI {url[:200]!r}: no query here")
        config = self._get(str(base.child(CONFIG_FILE)), CONFIG_FILE)
        return config, self._get(str(base.child(WEIGHTS_FILE)), WEIGHTS_FILE, sink)

    def _get(self, url: str, name: str, sink: Sink | None = None) -> bytes:
        came_from = ""
        for _ in range(MAX_REDIRECTS + 1):
            target, addresses = self._check_http(url, came_from)
            conn = _connection(target, addresses)
            try:
                conn.request(
                    "GET",
                    target.target,
                    headers={"Host": target.netloc, "Accept-Encoding": "identity", "User-Agent": "loraserve"},
                )
                resp = conn.getresponse()
                if resp.status in (301, 302, 303, 307, 308):
                    location = resp.getheader("Location")
                    if not location:
                        raise AdapterError(f"cannot read {url[:200]}: HTTP {resp.status} without a Location")
                    came_from, url = url, urljoin(str(target), location)
                    continue
                if resp.status != 200:
                    raise AdapterError(f"cannot read {url[:200]}: HTTP {resp.status}")
                declared = resp.getheader("Content-Length", "")
                if declared.isdigit() and int(declared) > self._limit(name):
                    raise self._too_big(url, name, int(declared))
                return self._collect(url, name, _chunks(resp), sink)
            except (OSError, http.client.HTTPException) as exc:
                raise AdapterError(f"cannot read {url[:200]}: {exc}") from None
            finally:
                conn.close()
        raise AdapterError(f"{url[:200]}: more than {MAX_REDIRECTS} redirects")


def _chunks(f: BinaryIO | http.client.HTTPResponse) -> Iterator[bytes]:
    """What ``f`` has, as it arrives (``read1``: a slow sender is seen at each packet, not at each MiB)."""
    read = f.read1 if isinstance(f, http.client.HTTPResponse) else f.read
    while chunk := read(CHUNK):
        yield chunk


def _resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to now (an IP literal: itself)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise AdapterError(f"cannot resolve {host}: {exc}") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _connection(url: _Url, addresses: list[str]) -> http.client.HTTPConnection:
    """A connection to ``url``'s host that connects only to ``addresses`` (those checked: a DNS answer that
    changes between the check and the connect is never used); TLS still verifies the host name."""
    cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    kw = {"context": ssl.create_default_context()} if url.scheme == "https" else {}
    conn = cls(url.host, url.port, timeout=SOCKET_TIMEOUT_S, **kw)

    def connect(_address, timeout, source_address=None):
        error: OSError | None = None
        for address in addresses:
            try:
                return socket.create_connection((address, url.port), timeout, source_address)
            except OSError as exc:
                error = exc
        raise error or OSError(f"no address for {url.host}")

    conn._create_connection = connect  # http.client's own hook for opening the socket
    return conn
