"""The Open-Jev decision service (package `openjev`)."""

import os

# gRPC's C core writes its own lines to stderr, plain text among the servers' JSON lines: one at
# INFO for every failed TLS handshake, which any peer can cause without a limit. Its errors only,
# unless the operator sets the variable; read at grpc's first import, which follows this package's.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
