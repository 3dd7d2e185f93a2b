"""A worker that fails an Execute stream while the frontend is still tokenizing its candidates
(its held-token budget refuses the stream part-way, or it goes away): a request that a later
candidate puts outside the contract gets the contract's INVALID_ARGUMENT (HTTP 422), never the
worker's status, with affinity on or off; a valid request gets the worker's status.

The worker is a fake (the fault is injected): it reads the header and the first batch, then
fails the call. The 17th question's one candidate (~380k tokens, under the 2 MB the frontend
refuses without tokenizing) takes the frontend about a second to tokenize, so the call fails
while it does. Before the fix the answer was the worker's status, or, with affinity, gRPC
UNKNOWN (HTTP 500) from a resend of a stream that had meanwhile ended on the contract error."""

from __future__ import annotations

import grpc
import httpx
import pytest
from fake_worker import FailsPartWay, fake_describe, part_way_body, serve_fake

from openjev.tools import launch
from openjev.v1 import decision_pb2 as api
from openjev.v1 import decision_pb2_grpc

TOO_LONG = "max_length=16384; no silent truncation"


def _body(last_candidate: str) -> str:
    return part_way_body(last_candidate, "short state")


@pytest.fixture(scope="module", params=["on", "off"])
def pair(request, demo_model, tmp_path_factory):
    worker = FailsPartWay(fake_describe(demo_model))
    server, port = serve_fake(worker)
    http_port = launch.free_port()
    frontend = launch.start_frontend(
        demo_model,
        f"127.0.0.1:{port}",
        tmp_path_factory.mktemp("part-way"),
        ["--worker-affinity", request.param, "--http-listen", f"127.0.0.1:{http_port}"],
    )
    try:
        launch.wait_serving(frontend.address)
        yield worker, frontend, http_port, request.param
    finally:
        frontend.stop()
        server.stop(0)


def _decide(frontend, body: str) -> grpc.RpcError:
    with grpc.insecure_channel(frontend.address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            decision_pb2_grpc.DecisionServiceStub(channel).Decide(api.DecideRequest(request_json=body), timeout=60)
    return caught.value


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
def test_a_later_candidate_over_max_length_is_invalid_argument(pair, code):
    worker, frontend, _, affinity = pair
    worker.code, worker.calls = code, 0
    error = _decide(frontend, _body("word " * 380_000))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith("question last: ") and error.details().endswith(TOO_LONG)
    # not retried once the check has spoken; with affinity a refusal that came before the second
    # batch's tokenizing began may have been resent once, round-robin (routing.Replay)
    resent = affinity == "on" and code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 1 <= worker.calls <= (2 if resent else 1)


def test_over_http_it_is_422(pair):
    worker, _, http_port, _ = pair
    worker.code = grpc.StatusCode.RESOURCE_EXHAUSTED
    with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as http:
        body = _body("word " * 380_000)
        reply = http.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"].endswith(TOO_LONG)


def test_a_valid_request_gets_the_workers_status(pair):
    worker, frontend, _, _ = pair
    worker.code = grpc.StatusCode.RESOURCE_EXHAUSTED
    error = _decide(frontend, _body("word " * 2_000))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "cannot hold" in error.details()
