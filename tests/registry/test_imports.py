"""``ImportAdapter`` reads only from the prefixes an admin allowed (``--import-allow``): a loopback web server,
a folder outside the store, ``..`` and symlinks out of an allowed folder, and redirects out of an allowed
prefix are all refused with PERMISSION_DENIED naming the rule, and nothing is stored."""

from __future__ import annotations

import hashlib
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraserve.common.errors import LoraserveError
from loraserve.registry.config import RegistryConfig
from tests.registry.conftest import TINY_MODEL, start_registry


@pytest.fixture
def web(adapter_dirs, tmp_path) -> Iterator[str]:
    """A loopback web server: /ok/a/ holds a PEFT folder, /bounce/* redirects to /ok/* or to /secret/*."""
    root = tmp_path / "web"
    shutil.copytree(adapter_dirs["all-r4"], root / "ok" / "a")
    shutil.copytree(adapter_dirs["all-r4"], root / "secret" / "a")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def do_GET(self):
            for prefix, target in (("/bounce-in/", "/ok/"), ("/ok/bounce-out/", "/secret/")):
                if self.path.startswith(prefix):
                    self.send_response(302)
                    self.send_header("Location", target + self.path.removeprefix(prefix))
                    self.end_headers()
                    return
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def _registry(tmp_path: Path, allow: str):
    store = str(tmp_path / "store")
    config = RegistryConfig(
        db=f"sqlite:///{tmp_path / 'r.db'}", storage=store, max_lora_rank=16, import_allow=allow
    )
    return start_registry(config, store)


def _denied(reg, uri: str, *words: str) -> None:
    with pytest.raises(LoraserveError) as err:
        reg.client.import_uri(uri, "imported", TINY_MODEL)
    assert err.value.code_name == "PERMISSION_DENIED", err.value.message
    assert "--import-allow" in err.value.message
    for word in words:
        assert word in err.value.message
    assert reg.adapter_rows() == [] and reg.blobs() == []


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
