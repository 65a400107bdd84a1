"""loraserve models: the decoder families in JAX, their weights and how they load, LoRA's slot pools and maths,
quantized bases, tensor-parallel layout, on-device sampling, the compiled step's contract and the planner.

No threads, no queues, no servers: what a device step computes and what it needs in memory. docs/architecture.md
lists every module."""
