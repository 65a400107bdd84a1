"""``ImportAdapter`` reads only from the prefixes an admin allowed (``--import-allow``): a loopback web server,
a folder outside the store, ``..`` and symlinks out of an allowed folder, and redirects out of an allowed
prefix are all refused with PERMISSION_DENIED naming the rule, and nothing is stored.

Tightened (#30 item 9): percent-encoded ``..`` (once or twice) in paths and in redirect targets, absolute
redirects through ``..``, ``/allowed-evil`` beside ``/allowed``, FIFOs, hosts that resolve to loopback or
other special addresses (unless a prefix names the host), user info; every source's size capped while it is
read (RESOURCE_EXHAUSTED). Only loopback is ever contacted."""

from __future__ import annotations

import hashlib
import http.server
import ipaddress
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraserve.common.errors import LoraserveError, PermissionDenied
from loraserve.registry.config import RegistryConfig
from loraserve.registry.imports import ImportPolicy, special_address
from tests.registry.conftest import TINY_MODEL, start_registry


@pytest.fixture
def web(adapter_dirs, tmp_path) -> Iterator[str]:
    """A loopback web server (SimpleHTTPRequestHandler: it percent-decodes and normalises ``..`` in paths, as
    many servers do): /ok/a/ holds a PEFT folder, so does /secret/a/; /bounce-in/* redirects to /ok/*,
    /ok/bounce-out/* to /secret/*, /ok/dots-out/* to BASE/ok/../secret/* and /ok/enc-out/* to
    BASE/ok/%2e%2e/secret/* (absolute); /ok/huge/ declares a 10 GB weights file and sends 1 KiB of it, /ok/endless/
    streams weights without a length until the reader hangs up (its config is /ok/a's)."""
    root = tmp_path / "web"
    shutil.copytree(adapter_dirs["all-r4"], root / "ok" / "a")
    shutil.copytree(adapter_dirs["all-r4"], root / "secret" / "a")
    done = threading.Event()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def do_GET(self):
            base = f"http://127.0.0.1:{self.server.server_address[1]}"
            redirects = (
                ("/bounce-in/", "/ok/"),
                ("/ok/bounce-out/", "/secret/"),
                ("/ok/dots-out/", f"{base}/ok/../secret/"),
                ("/ok/enc-out/", f"{base}/ok/%2e%2e/secret/"),
            )
            for prefix, target in redirects:
                if self.path.startswith(prefix):
                    self.send_response(302)
                    self.send_header("Location", target + self.path.removeprefix(prefix))
                    self.end_headers()
                    return
            for folder in ("/ok/huge/", "/ok/endless/"):
                if self.path == folder + "adapter_config.json":
                    self.path = "/ok/a/adapter_config.json"
                elif self.path == folder + "adapter_model.safetensors":
                    return self._weights(huge=folder == "/ok/huge/")
            super().do_GET()

        def _weights(self, huge: bool) -> None:
            self.send_response(200)
            if huge:
                self.send_header("Content-Length", str(10**10))
            self.end_headers()
            try:
                if huge:
                    self.wfile.write(b"x" * 1024)
                    self.wfile.flush()
                    done.wait(10)  # a reader that waits for the rest waits here
                    return
                for _ in range(1024):  # 64 MiB at most
                    self.wfile.write(b"x" * 65536)
            except OSError:  # the reader hung up
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        done.set()
        server.shutdown()


def _registry(tmp_path: Path, allow: str, **kw):
    store = str(tmp_path / "store")
    config = RegistryConfig(
        db=f"sqlite:///{tmp_path / 'r.db'}", storage=store, max_lora_rank=16, import_allow=allow, **kw
    )
    return start_registry(config, store)


def _refused(reg, uri: str, code: str, *words: str) -> str:
    with pytest.raises(LoraserveError) as err:
        reg.client.import_uri(uri, "imported", TINY_MODEL)
    assert err.value.code_name == code, (uri, err.value.code_name, err.value.message)
    for word in words:
        assert word in err.value.message, (uri, err.value.message)
    assert reg.adapter_rows() == [] and reg.blobs() == []
    return err.value.message


def _denied(reg, uri: str, *words: str) -> None:
    _refused(reg, uri, "PERMISSION_DENIED", "--import-allow", *words)


def test_default_allows_only_the_store(tmp_path, adapter_dirs, web) -> None:
    with _registry(tmp_path, "") as reg:
        _denied(reg, str(adapter_dirs["all-r4"]), "allows only", str(Path(reg.store_root).resolve()))
        _denied(reg, f"file://{adapter_dirs['all-r4']}")
        _denied(reg, f"{web}/ok/a")
        _denied(reg, "memory://somewhere/a")
        inside = Path(reg.store_root) / "imports" / "a"  # a PEFT folder an admin placed under the store
        shutil.copytree(adapter_dirs["all-r4"], inside)
        a = reg.client.import_uri(str(inside), "imported", TINY_MODEL)
        weights = (adapter_dirs["all-r4"] / "adapter_model.safetensors").read_bytes()
        assert (a.name, a.version, a.sha256) == ("imported", 1, hashlib.sha256(weights).hexdigest())


def test_allowed_folder_traversal_and_symlinks(tmp_path, adapter_dirs) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    shutil.copytree(adapter_dirs["all-r4"], allowed / "good")
    shutil.copytree(adapter_dirs["all-r4"], outside / "a")
    (allowed / "link").symlink_to(outside / "a", target_is_directory=True)  # a folder link out
    (allowed / "sneaky").mkdir()
    shutil.copy(adapter_dirs["all-r4"] / "adapter_config.json", allowed / "sneaky")
    (allowed / "sneaky" / "adapter_model.safetensors").symlink_to(outside / "a" / "adapter_model.safetensors")
    with _registry(tmp_path, str(allowed)) as reg:
        _denied(reg, str(outside / "a"))
        _denied(reg, f"{allowed}/../outside/a")  # .. resolves outside
        _denied(reg, str(allowed / "link"))
        _denied(reg, str(allowed / "sneaky"), "links outside")
        _denied(reg, str(tmp_path / "allowed-but-not-really"))  # a prefix of the name is not the folder
        assert reg.client.import_uri(str(allowed / "good"), "good", TINY_MODEL).version == 1
        assert reg.client.import_uri(f"file://{allowed}/good", "good", TINY_MODEL).version == 2


def test_http_prefix_and_redirects(tmp_path, web) -> None:
    with _registry(tmp_path, f"{web}/ok/, {web}/bounce-in/") as reg:
        _denied(reg, f"{web}/secret/a")
        _denied(reg, f"{web}/ok/../secret/a", "..")
        _denied(reg, f"{web}/ok/bounce-out/a", "redirects to")  # allowed prefix, redirect out of it
        assert reg.client.import_uri(f"{web}/ok/a", "web", TINY_MODEL).version == 1
        assert reg.client.import_uri(f"{web}/bounce-in/a", "web", TINY_MODEL).version == 2  # redirect inside
        with pytest.raises(LoraserveError) as err:  # allowed, but nothing there: the usual INVALID_ARGUMENT
            reg.client.import_uri(f"{web}/ok/missing", "web", TINY_MODEL)
        assert err.value.code_name == "INVALID_ARGUMENT" and "404" in err.value.message


def test_encoded_dots_sibling_prefixes_and_fifos_in_local_folders(tmp_path, adapter_dirs) -> None:
    allowed, outside, evil = tmp_path / "allowed", tmp_path / "outside", tmp_path / "allowed-evil"
    shutil.copytree(adapter_dirs["all-r4"], allowed / "good")
    shutil.copytree(adapter_dirs["all-r4"], outside / "a")
    shutil.copytree(adapter_dirs["all-r4"], evil / "a")
    (allowed / "%2e%2e").mkdir()  # a folder that really is named so: still refused, never guessed at
    (allowed / "%2e%2e" / "outside").symlink_to(outside, target_is_directory=True)
    (allowed / "pipe").mkdir()  # a FIFO would block a reader, or stream without end
    shutil.copy(adapter_dirs["all-r4"] / "adapter_config.json", allowed / "pipe")
    os.mkfifo(allowed / "pipe" / "adapter_model.safetensors")
    with _registry(tmp_path, f"{allowed}/") as reg:
        _denied(reg, f"file://{allowed}/%2e%2e/outside/a")  # decoded once: resolves outside
        _denied(reg, f"file://{allowed}/%2E%2E/outside/a")
        _denied(reg, f"file://{allowed}/%252e%252e/outside/a", "percent-encoded twice")
        _denied(reg, f"{allowed}/%2e%2e/outside/a", "percent escape")  # plain paths are not decoded
        _denied(reg, f"{allowed}/../outside/a")
        _denied(reg, f"{evil}/a")  # /allowed is no prefix of /allowed-evil
        _denied(reg, f"file://{evil}/a")
        _denied(reg, f"{allowed}-evil/a")
        _denied(reg, f"{allowed}/pipe", "not a regular file")
        _refused(reg, f"file://elsewhere{allowed}/good", "INVALID_ARGUMENT", "no other host")
        assert reg.client.import_uri(f"file://{allowed}/good/../good", "good", TINY_MODEL).version == 1
        assert reg.client.import_uri(f"file://localhost{allowed}/good", "good", TINY_MODEL).version == 2


def test_encoded_dots_and_absolute_redirects_through_dots_over_http(tmp_path, web) -> None:
    with _registry(tmp_path, f"{web}/ok/") as reg:
        _denied(reg, f"{web}/ok/%2e%2e/secret/a", "..")  # the server would decode it and serve /secret/a
        _denied(reg, f"{web}/ok/%2E%2E/secret/a", "..")
        _denied(reg, f"{web}/ok/%252e%252e/secret/a", "percent-encoded twice")
        _denied(reg, f"{web}/ok/..%2fsecret/a", "..")
        _denied(reg, f"{web}/ok/dots-out/a", "redirects", "..")  # Location: BASE/ok/../secret/a
        _denied(reg, f"{web}/ok/enc-out/a", "redirects", "..")  # Location: BASE/ok/%2e%2e/secret/a
        _denied(reg, f"{web}/ok/bounce-out/a", "redirects to")
        _denied(reg, f"{web}/okay/a")  # /ok is no prefix of /okay
        _denied(reg, f"{web.replace('http://', 'http://me@')}/ok/a", "user info")
        assert reg.client.import_uri(f"{web}/ok/./a", "web", TINY_MODEL).version == 1


def test_hosts_resolving_to_special_addresses_need_a_prefix_naming_them(tmp_path, web) -> None:
    port = web.rsplit(":", 1)[1]
    with _registry(tmp_path, "http://, https://") as reg:  # any host: public addresses only
        _denied(reg, f"{web}/ok/a", "127.0.0.1", "loopback")
        _denied(reg, f"http://localhost:{port}/ok/a", "loopback")
        _denied(reg, f"http://[::ffff:127.0.0.1]:{port}/ok/a", "loopback")  # IPv4-mapped IPv6
        _denied(reg, f"http://[::1]:{port}/ok/a", "loopback")
        _denied(reg, f"http://0.0.0.0:{port}/ok/a", "unspecified")
    with _registry(tmp_path / "named", f"{web}/, http://") as reg:  # this host named: allowed
        _denied(reg, f"http://localhost:{port}/ok/a", "loopback")  # another name is another host
        assert reg.client.import_uri(f"{web}/ok/a", "web", TINY_MODEL).version == 1


def test_the_connection_goes_to_the_addresses_checked(tmp_path, web) -> None:
    """Each connection is made to the addresses that were checked for it (DNS is not asked again between the
    check and the connect, so a second answer, DNS rebinding, is never used); TLS and the Host header still
    carry the name. Here the name resolves only through the stub: real DNS would fail."""
    port = int(web.rsplit(":", 1)[1])
    asked = []

    def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["127.0.0.1"]  # what "adapters.example" resolves to, for this test

    named = ImportPolicy([f"http://adapters.example:{port}/ok/"], str(tmp_path))
    named.resolve = resolve
    config, weights = named.read(f"http://adapters.example:{port}/ok/a")  # no real DNS: the stub's address
    served = tmp_path / "web" / "ok" / "a"  # the web fixture's folder
    assert (config, weights) == (
        (served / "adapter_config.json").read_bytes(),
        (served / "adapter_model.safetensors").read_bytes(),
    )
    assert set(asked) == {"adapters.example"}
    anyone = ImportPolicy(["http://"], str(tmp_path))
    anyone.resolve = resolve
    with pytest.raises(PermissionDenied, match=r"adapters\.example resolves to 127\.0\.0\.1, a loopback"):
        anyone.read(f"http://adapters.example:{port}/ok/a")


@pytest.mark.parametrize(
    "address, why",
    [
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("0.0.0.0", "unspecified"),
        ("100.64.0.1", "not global"),  # shared address space (carrier NAT)
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "private"),
        ("::1", "loopback"),
        ("fe80::1", "link-local"),
        ("fc00::1", "private"),
        ("::ffff:10.0.0.1", "private"),  # IPv4-mapped
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of 169.254.169.254
        ("8.8.8.8", ""),
        ("2001:4860:4860::8888", ""),
    ],
)
def test_special_addresses(address, why) -> None:  # no network: a function of the address
    assert special_address(ipaddress.ip_address(address)) == why


def test_every_source_is_capped_while_it_is_read(tmp_path, adapter_dirs, web) -> None:
    weights = (adapter_dirs["all-r4"] / "adapter_model.safetensors").stat().st_size
    cap = weights - 1
    folder = tmp_path / "store" / "big"
    shutil.copytree(adapter_dirs["all-r4"], folder)
    padded = tmp_path / "store" / "padded-config"  # valid JSON, 1 MiB of spaces
    shutil.copytree(adapter_dirs["all-r4"], padded)
    config = (padded / "adapter_config.json").read_bytes()
    (padded / "adapter_config.json").write_bytes(config + b" " * (1 << 20))
    allow = f"{tmp_path / 'store'}, {web}/ok/, memory://imports/"
    with _registry(tmp_path, allow, max_upload_bytes=cap) as reg:
        over = f"over --max-upload-bytes of {cap} bytes"
        _refused(reg, str(folder), "RESOURCE_EXHAUSTED", "adapter_model.safetensors", over)
        start = time.monotonic()  # a declared size over the cap: refused before reading the body
        _refused(reg, f"{web}/ok/huge", "RESOURCE_EXHAUSTED", "10000000000 bytes", over)
        assert time.monotonic() - start < 5
        _refused(reg, f"{web}/ok/endless", "RESOURCE_EXHAUSTED", over)  # no length: counted as it comes
        _refused(reg, f"{web}/ok/a", "RESOURCE_EXHAUSTED", over)
        import fsspec

        fs = fsspec.filesystem("memory")
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            fs.pipe_file(f"/imports/a/{name}", (adapter_dirs["all-r4"] / name).read_bytes())
        try:
            _refused(reg, "memory://imports/a", "RESOURCE_EXHAUSTED", over)
        finally:
            fs.rm("/imports", recursive=True)
    with _registry(tmp_path / "default-cap", str(padded)) as reg:
        _refused(reg, str(padded), "RESOURCE_EXHAUSTED", "adapter_config.json", "over the config limit")


def test_weights_can_stream_to_a_sink(tmp_path, adapter_dirs, web) -> None:
    """``read(url, sink)`` hands the weights over as they arrive (a registry can spool them to a file), for
    every scheme; what comes back in their place is empty."""
    folder = tmp_path / "store" / "a"
    shutil.copytree(adapter_dirs["all-r4"], folder)
    expected = (
        (folder / "adapter_config.json").read_bytes(),
        (folder / "adapter_model.safetensors").read_bytes(),
    )
    policy = ImportPolicy([str(tmp_path / "store"), f"{web}/ok/"], str(tmp_path / "store"))
    for uri in (str(folder), f"file://{folder}", f"{web}/ok/a"):
        chunks: list[bytes] = []
        config, weights = policy.read(uri, chunks.append)
        assert (config, weights, b"".join(chunks)) == (expected[0], b"", expected[1])
        assert policy.read(uri) == expected
