"""A worker servicer of the test's own on loopback, for faults a real worker cannot be made to
show: its Describe matches the demo export, so a real frontend pairs with it."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from openjev import abi
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc


def fake_describe(demo_model, execute_unary: bool = False) -> wire.DescribeResponse:
    from openjev.export import load_export_meta
    from openjev.tokenizer import PromptTokenizer

    meta = load_export_meta(demo_model)
    return wire.DescribeResponse(
        abi_version=abi.ABI_VERSION,
        model_id=meta.model_id,
        checkpoint_revision="fake",
        temperature=meta.temperature,
        max_length=meta.max_length,
        tokenizer_fingerprint=PromptTokenizer.from_export(demo_model).fingerprint,
        backend="fake",
        default_prefix_policy=abi.policy_to_enum("off"),  # the fleet header's, compared at connect
        limits=wire.Limits(max_questions=4096, max_candidates=65536),
        execute_unary=execute_unary,
    )


def serve_fake(servicer: worker_pb2_grpc.WorkerServiceServicer, threads: int = 8) -> tuple[grpc.Server, int]:
    """The servicer on a loopback port, its health SERVING: (server, port)."""
    server = grpc.server(futures.ThreadPoolExecutor(threads))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def part_way_body(last_candidate: str, state: str) -> str:
    """A request FailsPartWay fails part-way: 16 noul questions (the first batch), then a choice
    whose one candidate's description is `last_candidate` (the second)."""
    questions = {f"q{i}": {"type": "noul", "instructions": "ok?"} for i in range(16)}
    questions["last"] = {"type": "choice", "instructions": "which?", "criteria": {"a": last_candidate}}
    return json.dumps({"state": state, "questions": questions})


class FailsPartWay(worker_pb2_grpc.WorkerServiceServicer):
    """Reads an Execute stream's header and first batch, then fails the call with `code`."""

    def __init__(self, describe):
        self.describe = describe
        self.code = grpc.StatusCode.RESOURCE_EXHAUSTED
        self.calls = 0

    def Describe(self, request, context):
        return self.describe

    def Execute(self, request_iterator, context):
        self.calls += 1
        try:
            next(request_iterator)  # the header
            next(request_iterator)  # the first batch: the frontend now tokenizes the second
        except grpc.RpcError as gone:  # the frontend refused the request itself and cancelled first
            gone.__traceback__ = None  # grpc keeps the error: no cycle through this frame either
            return
        # not context.abort: the error it raises is left in a cycle in this process, where
        # test_no_cycles.py counts what a refused request leaves
        context.set_code(self.code)
        context.set_details("worker cannot hold 123 more candidate tokens now; retry later")
        return
        yield  # a generator, as the real servicer
