"""loraserve: serve many LoRA adapters on one base model.

One import root for every room of the system (docs/design.md §10.1); each room is a folder at the
repository's top, mapped here by ``pyproject.toml``'s ``package-dir``:

``loraserve.protos`` (the gRPC contract), ``loraserve.common`` (server scaffold, errors, auth/TLS,
channels, config, metrics and logs), ``loraserve.adapters`` (the PEFT adapter format), ``loraserve.kernels``
(batched multi-LoRA ops), ``loraserve.worker``, ``loraserve.registry``, ``loraserve.router`` and
``loraserve.client`` (SDK and CLI commands). ``docs/architecture.md`` says what each may import.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("loraserve")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
