"""What every server and client shares: errors (``errors``) and the interceptor that maps them to statuses and
records RPC metrics (``interceptors``), the server build and serve lifecycle (``server.run_server``), auth/TLS
and channels (``security``), configuration from flags and environment (``config``), metrics and logs
(``observability``), finish reasons (``finish_reasons``) and the ``loraserve`` process launcher
(``processes``). Imports nothing of ours but ``loraserve.protos`` (and no JAX)."""
