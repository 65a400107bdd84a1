"""The files of a PEFT adapter folder, read from a local path or any fsspec URL (no numpy, no JAX: the SDK's push
uses this)."""

from __future__ import annotations

import fsspec

from loraserve.adapters.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "adapter_model.ckpt")


def read_adapter_files(url: str) -> tuple[bytes, bytes]:
    """Read ``(adapter_config.json, adapter_model.safetensors)`` bytes from a folder path or fsspec URL.

    A missing, pickle-only or unreadable folder raises ``AdapterError`` (INVALID_ARGUMENT).
    """
    try:
        return _read(url)
    except OSError as exc:  # permissions, a directory where a file should be, an fsspec backend error
        raise AdapterError(f"cannot read the adapter folder {url}: {exc}") from exc


def _read(url: str) -> tuple[bytes, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if not fs.exists(f"{root}/{WEIGHTS_FILE}"):
        pickled = [name for name in PICKLE_FILES if fs.exists(f"{root}/{name}")]
        if pickled:
            raise AdapterError(f"{pickled[0]} is a pickle file, which is refused (loading it can run code)")
        raise AdapterError(f"no {WEIGHTS_FILE} in {url}")
    if not fs.exists(f"{root}/{CONFIG_FILE}"):
        raise AdapterError(f"no {CONFIG_FILE} in {url}")
    return fs.cat_file(f"{root}/{CONFIG_FILE}"), fs.cat_file(f"{root}/{WEIGHTS_FILE}")
