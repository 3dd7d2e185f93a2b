"""`python -m openjev.healthcheck ADDR`: exit 0 when the server at ADDR reports SERVING through
`grpc.health.v1`, 1 otherwise. The container health check of `deploy/docker-compose.yml` and the
exec probe of `deploy/k8s/` (Kubernetes' native `grpc:` probes speak plaintext only).

A server on TLS is checked over TLS: `--tls-ca` (the CA that signed its certificate), plus a
client certificate (`--tls-cert`, `--tls-key`) for a server that requires one (the worker under
mutual TLS), and `--tls-server-name` where the certificate does not name the address dialled.
Each flag also comes from `OPENJEV_HEALTHCHECK_<FLAG>` (`OPENJEV_HEALTHCHECK_TLS_CA`, ...), so the
image's health-check command stays the same whether the server is on TLS or not.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from openjev import logs

logs.quiet_grpc_core()  # before grpc's first import; the failure's cause goes to stderr below instead

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openjev import config, security

ENV_PREFIX = "OPENJEV_HEALTHCHECK_"
TLS_FLAGS = ("tls_ca", "tls_cert", "tls_key", "tls_server_name")


def check(
    address: str,
    service: str = "",
    timeout_seconds: float = 2.0,
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str | None = None,
) -> tuple[str, str]:
    """The status name (SERVING, NOT_SERVING, ...) or the gRPC error code name, and the error's
    details ('' for a status)."""
    if credentials is None:
        channel = grpc.insecure_channel(address)
    else:
        options = [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
        channel = grpc.secure_channel(address, credentials, options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_seconds
            )
        except grpc.RpcError as error:
            return error.code().name, error.details() or ""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), ""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m openjev.healthcheck", description=__doc__)
    p.add_argument("address", type=config.dial_address, help="HOST:PORT of a frontend or worker")
    p.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    p.add_argument("--timeout", type=config.positive_float, default=2.0, help="seconds")
    security.add_client_tls_arguments(p, "server")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    for dest in TLS_FLAGS:  # an empty or blank variable counts as unset, as for the servers' flags
        value = os.environ.get(ENV_PREFIX + dest.upper())
        if value and not value.isspace():
            p.set_defaults(**{dest: value if dest == "tls_server_name" else Path(value)})
    args = p.parse_args(argv)

    def read(path: Path, _what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as error:
            p.error(f"cannot read {error.filename}: {error.strerror}")
            raise  # p.error exits

    credentials, _ = security.client_tls(args, p.error, read)  # check() sets the server name itself
    status, details = check(args.address, args.service, args.timeout, credentials, args.tls_server_name)
    print(status)
    if details:  # why it failed (a refused handshake, no listener), one line
        print(details, file=sys.stderr)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
