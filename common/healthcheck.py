"""`python -m openjev.healthcheck ADDR`: exit 0 when the server at ADDR reports SERVING through
`grpc.health.v1`, 1 otherwise. The container health check of `deploy/docker-compose.yml`
(Kubernetes probes the same service natively with `grpc:` probes)."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_seconds: float = 2.0) -> str:
    """The status name (SERVING, NOT_SERVING, ...) or the gRPC error code name."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_seconds
            )
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="openjev-healthcheck", description=__doc__)
    p.add_argument("address", help="HOST:PORT of a frontend or worker")
    p.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds")
    args = p.parse_args(argv)
    status = check(args.address, args.service, args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
