"""loraserve registry: adapter metadata in SQL, adapter weights in object storage, placement of adapters on workers."""
