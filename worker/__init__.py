"""loraserve worker: a JAX Llama-family model with hot-swappable LoRA slots behind a streaming gRPC server."""
