"""loraserve router: the adapter-affinity front door implementing Inference.Generate."""
