"""Both servers expose grpc.health.v1 and server reflection, and a worker stops cleanly on SIGTERM."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from openjev.tools import launch


def listed_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    return {s.name for s in replies[0].list_services_response.service}


def test_reflection_lists_each_server_api(pair):
    assert {"openjev.v1.DecisionService", "grpc.health.v1.Health"} <= listed_services(pair.frontend.address)
    assert {"openjev.worker.v1.WorkerService", "grpc.health.v1.Health"} <= listed_services(pair.worker.address)


def test_health_serving_per_service(pair):
    for address, service in (
        (pair.frontend.address, "openjev.v1.DecisionService"),
        (pair.worker.address, "openjev.worker.v1.WorkerService"),
    ):
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_worker_exits_cleanly_on_sigterm(demo_model, tmp_path):
    worker = launch.start_worker(demo_model, tmp_path)
    assert worker.stop(timeout_seconds=20) == 0
    assert '"event": "stopped"' in worker.log_text()
