"""What every server and client shares: the gRPC server scaffold, errors, auth/TLS and channels, configuration
from the environment, metrics and logs. Imports nothing of ours but ``loraserve.protos`` (and no JAX)."""
