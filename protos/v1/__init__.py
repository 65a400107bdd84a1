"""Generated modules of the loraserve.v1 contract (``make protos``); only this file is written by hand."""
