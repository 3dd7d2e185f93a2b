"""Both servers expose grpc.health.v1 and server reflection, and a worker stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from openjev.tools import launch
from openjev.v1 import decision_pb2 as api


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


SERVICE = "openjev.v1.DecisionService"  # a name reflection can describe


def test_closed_health_watches_leave_nothing_behind():
    """grpcio's health servicer kept each Watch's service name after its stream closed: unique
    names, no token needed, up to a message each, grew the process for good (a review,
    2026-12-04: 300 names of 4 MB, +1.2 GB). Watches of the server's own names still work."""
    from openjev import serving

    server = serving.build_server("127.0.0.1:0", lambda s: None, [SERVICE])
    try:
        server.set_serving(True)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for i in range(20):
                stream = stub.Watch(health_pb2.HealthCheckRequest(service=f"name-{i}-" + "x" * 10_000), timeout=10)
                assert next(stream).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                stream.cancel()
            kept = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
            assert next(kept).status == health_pb2.HealthCheckResponse.SERVING
            server.set_serving(False)
            assert next(kept).status == health_pb2.HealthCheckResponse.NOT_SERVING
            kept.cancel()
            deadline = time.monotonic() + 10
            while server.health._send_response_callbacks and time.monotonic() < deadline:
                time.sleep(0.05)
        assert server.health._send_response_callbacks == {}
    finally:
        server.grpc_server.stop(0).wait()


def test_compressed_calls_are_refused_on_both_servers(pair, client):
    """gzip let ~23 KB on the wire become a 22.5 MiB message of nested arrays, past any proxy's
    request-size limit (a review, 2026-12-04). Both servers take identity only; the frontend
    answers an uncompressed request as before."""
    request = health_pb2.HealthCheckRequest()
    for address in (pair.frontend.address, pair.worker.address):
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Check(request, timeout=10, compression=grpc.Compression.Gzip)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED, address
            assert "gzip" in refused.value.details() and "disabled" in refused.value.details()
            assert stub.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    noul = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}
    decide = api.DecideRequest(request_json=json.dumps(noul))
    with pytest.raises(grpc.RpcError) as refused:
        client.stub.Decide(decide, timeout=30, compression=grpc.Compression.Deflate)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert client.stub.Decide(decide, timeout=30).answers
