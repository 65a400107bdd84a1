"""The OpenAI-compatible HTTP API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``), served by the
router and the workers next to their gRPC port (``--http-port``). Needs the ``http`` extra (FastAPI, uvicorn)."""
