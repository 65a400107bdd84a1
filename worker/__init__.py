"""loraserve worker: the process around the engine: gRPC and HTTP servers, flags, registration with the
registry, adapters from the registry, metrics, the tokenizer and detokenisation, the plan and quantize commands."""
