"""loraserve engine: the host side of serving (scheduler, adapter residency and slots, KV pages and the prefix
cache, KV events) over a runner (the JAX runner on the device, the fake runner without a model), multi-host
replay, and the engine's configuration. It speaks no protos: the worker turns its values into messages.
docs/architecture.md lists every module."""
