"""loraserve client side: the Python SDK and the ``loraserve`` command line."""
