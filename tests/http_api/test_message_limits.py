"""The public port's message limit (`--max-message-bytes`) against a real pair: an answer larger
than it is refused by the frontend (INVALID_ARGUMENT, as the other size limits), and logged and
counted as refused; the HTTP route, which has no message limit, answers the same request."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest

from openjev.client import Client
from openjev.tools import soak
from openjev.tools.soak import log_events
from openjev.v1 import decision_pb2 as api

LIMIT = 16 * 1024


def _outcome(url: str, outcome: str) -> float:
    return soak.outcome_counts(f"{url}/metrics", "openjev_frontend_request_seconds_count").get(outcome, 0.0)


@pytest.fixture(scope="module")
def limited(demo_model, tmp_path_factory, http_pair_factory):
    started = http_pair_factory(
        demo_model, tmp_path_factory.mktemp("limited"), frontend_args=["--max-message-bytes", str(LIMIT)]
    )
    yield started
    started.pair.stop()


def test_an_answer_over_the_message_limit_is_refused_before_it_is_sent(limited):
    # A choice's key comes back twice (keys and choice): a 12 KB request, a 24 KB answer.
    key = "the proposed answer, at length. " * 384
    request = {"state": "s", "questions": {"q": {"type": "choice", "instructions": "?", "criteria": {key: None}}}}
    body = json.dumps(request)
    assert len(body) < LIMIT
    before = _outcome(limited.url, "INVALID_ARGUMENT")
    with Client(limited.grpc_address) as client:
        noul = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}
        small = client.stub.Decide(api.DecideRequest(request_json=json.dumps(noul)), timeout=60)
        assert small.ByteSize() < LIMIT and small.answers
        with pytest.raises(grpc.RpcError) as caught:
            client.stub.Decide(
                api.DecideRequest(request_json=body), metadata=(("x-request-id", "big-answer"),), timeout=60
            )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    size = int(caught.value.details().split("(")[1].split(" vs.")[0])
    assert caught.value.details() == f"answer message larger than max ({size} vs. {LIMIT} bytes)"
    assert size > 2 * len(key)
    lines = [r for r in log_events(limited.pair.frontend.log_text(), "decide") if r.get("request_id") == "big-answer"]
    assert [r["status"] for r in lines] == ["INVALID_ARGUMENT"], lines
    deadline = time.monotonic() + 10
    while _outcome(limited.url, "INVALID_ARGUMENT") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _outcome(limited.url, "INVALID_ARGUMENT") == before + 1

    # HTTP carries any size of answer: the same request is answered there, whole.
    with httpx.Client(base_url=limited.url, timeout=60) as http:
        reply = http.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["answers"]["q"]["choice"] == key
