"""Addresses servers listen on and processes dial: ``HOST:PORT`` (TCP) or ``unix:PATH`` (a unix socket).

Forms (gRPC's own target syntax, so every client dials them as they are):

- ``HOST:PORT``: a host name, an IPv4 address or a bracketed IPv6 address (``[::1]:50061``), and a port;
- ``unix:PATH`` or ``unix:///ABSOLUTE/PATH``: a unix-domain socket file, for machines that allow no TCP at all
  (sidecars, sandboxes). Its canonical form, the one servers print and workers register, is
  ``unix:/absolute/path``. A path holds no whitespace or control character and at most
  ``MAX_UNIX_PATH_BYTES`` bytes (the kernel's ``sun_path``).

A *listen* address (``--listen``, what a server binds) may have port 0 (any free port) and a relative socket
path (resolved against the working folder at start); a *dial* address (what a worker registers, so routers on
other machines or in other folders reach it) needs a port of 1-65535 and an absolute path.

A server binding a unix socket ``claim_unix_socket``s its path first: a socket file that no process listens on
(left by a crashed process) is removed, so it does not stand in the way of a restart; one that a live process
listens on is refused (gRPC would otherwise take the path over from it silently). On clean shutdown the server removes its
own socket file (``release_unix_socket``).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import re
import socket
import stat
from dataclasses import dataclass

from loraserve.common.errors import InvalidArgument, Unavailable

UNIX = "unix:"
MAX_UNIX_PATH_BYTES = 107  # sun_path holds 108 bytes, its terminating NUL included
MAX_DIAL_CHARS = 256  # the registry's workers.address column
_PORT = re.compile(r"[0-9]{1,5}")
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")  # a DNS name; an IPv4 address is one too
# the help of every server's --listen (its role's help adds what it does with it)
LISTEN_HELP = (
    "address the gRPC server listens on, instead of --host and --port: unix:PATH (or unix:///abs/path) for a"
    " unix-domain socket file (one left by a process that is gone is replaced; removed at shutdown), or"
    " HOST:PORT (empty: --host and --port)"
)
NEITHER = (
    "is neither HOST:PORT (e.g. 10.0.0.5:50061, [::1]:50061) nor unix:PATH (e.g. unix:/run/loraserve/w.sock)"
)


class AddressError(InvalidArgument, ValueError):
    """An address that is neither ``HOST:PORT`` nor ``unix:PATH`` (INVALID_ARGUMENT); a ``ValueError`` too, so
    a config dataclass refusing one reads as any refused value (``common.config``)."""


@dataclass(frozen=True)
class Address:
    """One parsed address: ``path`` set for a unix-domain socket, else ``host`` and ``port``."""

    host: str = ""
    port: int = 0
    path: str = ""

    @property
    def unix(self) -> bool:
        return bool(self.path)

    def __str__(self) -> str:
        return UNIX + self.path if self.path else join_host_port(self.host, self.port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::]:50061``)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_unix(address: str) -> bool:
    return address.startswith(UNIX)


def _ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def _unprintable(text: str) -> bool:
    return any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in text)


def parse_address(text: str, *, listen: bool = False, what: str = "address") -> Address:
    """``text`` parsed, or ``AddressError`` naming ``what``. ``listen``: an address to bind (port 0 and
    relative socket paths allowed, the path made absolute); else one to dial (port 1-65535, absolute path)."""
    if is_unix(text):
        return Address(path=_unix_path(text, listen, what))
    if not listen and len(text) > MAX_DIAL_CHARS:
        raise AddressError(f"{what} is {len(text)} characters long: at most {MAX_DIAL_CHARS}")
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or text[close + 1 : close + 2] != ":":
            raise AddressError(f"{what} {text!r} {NEITHER}")
        host, port = text[1:close], text[close + 2 :]
        if not _ipv6(host):
            raise AddressError(f"{what} {text!r}: {host!r} in brackets is no IPv6 address")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise AddressError(f"{what} {text!r} {NEITHER}")
        if ":" in host:
            if _ipv6(host):
                raise AddressError(f"{what} {text!r}: an IPv6 address goes in brackets, as in [::1]:50061")
            raise AddressError(f"{what} {text!r} {NEITHER}")
        # a server binds whatever gRPC accepts (as --host always did); what others dial must be a name
        if _unprintable(host) if listen else not _HOST.fullmatch(host):
            raise AddressError(f"{what} {text!r}: {host!r} is no host name or IP address")
    lowest = 0 if listen else 1
    if not _PORT.fullmatch(port) or not lowest <= int(port) <= 65535:
        raise AddressError(f"{what} {text!r}: the port must be a number from {lowest} to 65535")
    return Address(host=host, port=int(port))


def _unix_path(text: str, listen: bool, what: str) -> str:
    path = text[len(UNIX) :]
    if path.startswith("//"):  # unix:///abs/path: a URI with an empty authority
        path = path[2:]
        if not path.startswith("/"):
            raise AddressError(
                f"{what} {text!r}: unix:// is followed by an absolute path (unix:///run/x.sock)"
            )
    if not path:
        raise AddressError(f"{what} {text!r} names no socket path")
    if _unprintable(path):
        raise AddressError(f"{what} {text!r}: a socket path holds no whitespace or control character")
    if listen:
        path = os.path.abspath(path)
    elif not path.startswith("/"):
        raise AddressError(
            f"{what} {text!r}: the socket path must be absolute (unix:/run/loraserve/worker.sock): other"
            " processes dial it from folders of their own"
        )
    if len(path.encode()) > MAX_UNIX_PATH_BYTES:
        raise AddressError(
            f"{what} {text!r}: the socket path is {len(path.encode())} bytes long; a unix socket's holds at"
            f" most {MAX_UNIX_PATH_BYTES}"
        )
    return path


def serve_address(listen: str, host: str, port: int) -> str:
    """Where a server's gRPC port goes: ``--listen`` when set, else ``--host`` and ``--port``."""
    return listen or join_host_port(host, port)


def check_listen_flags(listen: str, host: str) -> None:
    """A server config's check at start: ``listen`` (when set) is a listen address, ``host`` no unix one."""
    if is_unix(host):
        raise AddressError(f"host {host!r}: --host names a TCP interface; a unix socket is --listen {host}")
    if listen:
        parse_address(listen, listen=True, what="listen")


# ------------------------------------------------------------------------------------ unix socket files


def socket_file(path: str) -> tuple[int, int] | None:
    """``(device, inode)`` of the socket file at ``path``; None when there is none (or no socket there)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def claim_unix_socket(path: str) -> None:
    """Make ``path`` free to bind: a socket file nobody listens on is removed. UNAVAILABLE when a live process
    listens on it, when something else than a socket is there, or when its folder does not exist."""
    where = UNIX + path
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise Unavailable(f"cannot bind {where}: no folder {folder}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise Unavailable(f"cannot bind {where}: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno != errno.ECONNREFUSED:  # a full backlog, no permission: it may well be live
            raise Unavailable(f"cannot bind {where}: the socket there may be in use ({exc})") from exc
    else:
        raise Unavailable(f"cannot bind {where}: another process is serving on it")
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):  # nobody listens: left by a process that did not shut down
        os.unlink(path)


def release_unix_socket(path: str, bound: tuple[int, int] | None) -> None:
    """Remove the socket file at ``path`` if it is still the one this process bound (``socket_file`` taken
    after binding); another process's socket at the same path stays."""
    if bound is not None and socket_file(path) == bound:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
