"""The frontend's two worker calls, through real frontends on loopback: ExecuteUnary (one message
each way) for a request of at most one batch when the worker offers it, the Execute stream
otherwise. In front of a real worker sits a counting proxy that offers ExecuteUnary or not, or
offers it and then answers UNIMPLEMENTED (a worker replaced by an older build since the last
Describe); without ExecuteUnary it registers only Describe and Execute, as an older worker does."""

from __future__ import annotations

from collections import Counter
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from openjev.client import Client
from openjev.tools import launch
from openjev.tools.soak import comparable, log_events
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

SERVICE = wire.DESCRIPTOR.services_by_name["WorkerService"].full_name
NOUL = {"state": "The parcel arrived late.", "questions": {"q": {"type": "noul", "instructions": "Upset?"}}}
CHOICE_16 = {
    "state": {"ticket": "refund twice", "amount": 1e-05},
    "questions": {
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {f"team {i}": None for i in range(14)}},
        "urgent": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "high"]},
    },
}
CHOICE_17 = {
    "state": "Which one?",
    "questions": {"q": {"type": "choice", "instructions": "Pick", "criteria": {f"k{i}": f"#{i}" for i in range(17)}}},
}
REQUESTS = {"noul": (NOUL, "ExecuteUnary"), "16 candidates": (CHOICE_16, "ExecuteUnary"), "17": (CHOICE_17, "Execute")}


class _Count(grpc.ServerInterceptor):
    """Counts Execute and ExecuteUnary calls as they arrive, served or not."""

    def __init__(self, calls: Counter[str]):
        self.calls = calls

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if method in ("Execute", "ExecuteUnary"):
            self.calls[method] += 1
        return continuation(handler_call_details)


class _Proxy:
    """A worker server in front of a real worker: forwards calls (deadline, request id and
    cancellation included), counts them by method, and offers ExecuteUnary as told."""

    def __init__(self, address: str, *, offers_unary: bool, serves_unary: bool):
        self.channel = grpc.insecure_channel(address)
        self.real = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.offers_unary = offers_unary
        self.calls: Counter[str] = Counter()
        handlers = {
            "Describe": grpc.unary_unary_rpc_method_handler(
                self.describe, wire.DescribeRequest.FromString, wire.DescribeResponse.SerializeToString
            ),
            "Execute": grpc.stream_stream_rpc_method_handler(
                self.execute, wire.ExecuteRequest.FromString, wire.ExecuteResponse.SerializeToString
            ),
        }
        if serves_unary:
            handlers["ExecuteUnary"] = grpc.unary_unary_rpc_method_handler(
                self.execute_unary, wire.ExecuteUnaryRequest.FromString, wire.ExecuteUnaryResponse.SerializeToString
            )
        self.server = grpc.server(futures.ThreadPoolExecutor(16), interceptors=[_Count(self.calls)])
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        health_servicer = health.HealthServicer()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def describe(self, request, context):
        describe = self.real.Describe(request, timeout=10)
        describe.execute_unary = self.offers_unary
        return describe

    def execute(self, request_iterator, context):
        call = self.real.Execute(
            request_iterator, timeout=context.time_remaining(), metadata=context.invocation_metadata()
        )
        context.add_callback(call.cancel)
        context.send_initial_metadata(call.initial_metadata())
        yield from call

    def execute_unary(self, request, context):
        future = self.real.ExecuteUnary.future(
            request, timeout=context.time_remaining(), metadata=context.invocation_metadata()
        )
        context.add_callback(future.cancel)
        return future.result()

    def stop(self) -> None:
        self.server.stop(0)
        self.channel.close()


@pytest.fixture(scope="module")
def worker(demo_model, tmp_path_factory):
    process = launch.start_worker(demo_model, tmp_path_factory.mktemp("unary-worker"), ["--state-cache-bytes", "0"])
    yield process
    process.stop()


def _frontend(demo_model, tmp_path, proxy: _Proxy, *args: str):
    frontend = launch.start_frontend(demo_model, proxy.address, tmp_path, args)
    launch.wait_serving(frontend.address, timeout_seconds=60)
    return frontend


def _decide_lines(frontend) -> list[dict]:
    return log_events(frontend.log_text(), "decide")


def test_unary_where_offered_and_the_stream_elsewhere_give_the_same_answers(demo_model, tmp_path, worker):
    new = _Proxy(worker.address, offers_unary=True, serves_unary=True)
    old = _Proxy(worker.address, offers_unary=False, serves_unary=False)  # a worker from before
    new_frontend = _frontend(demo_model, tmp_path / "new", new)
    old_frontend = _frontend(demo_model, tmp_path / "old", old)
    try:
        with Client(new_frontend.address) as via_new, Client(old_frontend.address) as via_old:
            for name, (request, method) in REQUESTS.items():
                calls_before = Counter(new.calls)
                answer = via_new.decide(request, timeout=60)
                assert new.calls - calls_before == Counter({method: 1}), name
                assert comparable(answer) == comparable(via_old.decide(request, timeout=60)), name
                assert answer["usage"]["input_tokens"] > 0
        assert old.calls == Counter({"Execute": len(REQUESTS)})  # never offered: never called
        methods = [line["worker_method"] for line in _decide_lines(new_frontend)]
        assert methods == [method for _request, method in REQUESTS.values()]
    finally:
        new_frontend.stop()
        old_frontend.stop()
        new.stop()
        old.stop()


def test_worker_replaced_by_an_older_one_falls_back_to_the_stream(demo_model, tmp_path, worker):
    # Offers ExecuteUnary in Describe but answers it UNIMPLEMENTED: what the frontend meets when a
    # worker behind its address was replaced by an older build since its last Describe.
    proxy = _Proxy(worker.address, offers_unary=True, serves_unary=False)
    frontend = _frontend(demo_model, tmp_path, proxy, "--worker-refresh-seconds", "600")
    try:
        with Client(frontend.address) as client:
            first = client.decide(NOUL, timeout=60)
            assert proxy.calls == Counter({"ExecuteUnary": 1, "Execute": 1})  # refused unrun, then streamed
            second = client.decide(NOUL, timeout=60)
            assert proxy.calls == Counter({"ExecuteUnary": 1, "Execute": 2})  # streams from then on
        assert comparable(first) == comparable(second)
        assert len(log_events(frontend.log_text(), "worker_no_execute_unary")) == 1
        assert [line["status"] for line in _decide_lines(frontend)] == ["OK", "OK"]
    finally:
        frontend.stop()
        proxy.stop()


def test_candidate_too_long_on_the_unary_path_sends_nothing(demo_model, tmp_path, worker):
    proxy = _Proxy(worker.address, offers_unary=True, serves_unary=True)
    frontend = _frontend(demo_model, tmp_path, proxy)
    too_long = {"state": "word " * 17000, "questions": {"q": {"type": "noul", "instructions": "Long?"}}}
    try:
        with Client(frontend.address) as client, pytest.raises(grpc.RpcError) as caught:
            client.decide(too_long, timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("question q: ")
        assert caught.value.details().endswith("tokens exceeds max_length=16384; no silent truncation")
        assert proxy.calls == Counter()  # tokenized whole before the one call: nothing reached a worker
    finally:
        frontend.stop()
        proxy.stop()


def test_a_mixed_fleet_is_streamed_to(demo_model, tmp_path, worker):
    """Two workers behind one frontend, one of them older: a request may land on either, so
    the frontend streams to both until every worker offers ExecuteUnary."""
    new = _Proxy(worker.address, offers_unary=True, serves_unary=True)
    old = _Proxy(worker.address, offers_unary=False, serves_unary=False)
    frontend = launch.start_frontend(demo_model, f"{new.address},{old.address}", tmp_path)
    try:
        launch.wait_serving(frontend.address, timeout_seconds=60)
        with Client(frontend.address) as client:
            for _ in range(4):
                client.decide(NOUL, timeout=60)
        assert new.calls["ExecuteUnary"] == old.calls["ExecuteUnary"] == 0
        assert new.calls["Execute"] + old.calls["Execute"] == 4
    finally:
        frontend.stop()
        new.stop()
        old.stop()
