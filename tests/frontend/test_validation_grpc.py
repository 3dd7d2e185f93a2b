"""Every contract validation message through the real gRPC API, one case each, in the
documented order: INVALID_ARGUMENT with the exact message."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from openjev.v1 import decision_pb2 as api

STATE = "A customer says: I was charged twice."
CHOICE = {"type": "choice", "instructions": "Pick", "criteria": {"a": None, "b": "bee"}}


def req(**overrides):
    body = {"state": STATE, "questions": {"q": CHOICE}}
    body.update(overrides)
    return body


CASES = [
    ("model", req(model="some-other-model"), "requested model is not loaded"),
    ("no state", {"questions": {"q": CHOICE}}, "request requires state"),
    # As the reference: only a missing state "requires" one; a present null has the wrong type.
    ("null state", req(state=None), "state must be text, a JSON object, or an array"),
    ("state number", req(state=3), "state must be text, a JSON object, or an array"),
    ("questions list", req(questions=[CHOICE]), "questions must be an object"),
    ("questions empty", req(questions={}), "questions must be nonempty and within the server question limit"),
    (
        "too many questions",
        req(questions={f"q{i}": {"type": "noul", "instructions": "x"} for i in range(4097)}),
        "questions must be nonempty and within the server question limit",
    ),
    ("definition", req(questions={"q": "choice"}), "question definition must be an object"),
    (
        "instructions",
        req(questions={"q": {"type": "choice", "instructions": 5, "criteria": {"a": None}}}),
        "instructions and descriptions must be text, an object, or an array",
    ),
    (
        "instructions before type",
        req(questions={"q": {"type": "bogus", "instructions": None}}),
        "instructions and descriptions must be text, an object, or an array",
    ),
    (
        "choice criteria",
        req(questions={"q": {"type": "choice", "instructions": "x", "criteria": ["a"]}}),
        "Choice requires an object",
    ),
    (
        "choice count 0",
        req(questions={"q": {"type": "choice", "instructions": "x", "criteria": {}}}),
        "Choice requires between 1 and 255 candidates",
    ),
    (
        "choice count 256",
        req(questions={"q": {"type": "choice", "instructions": "x", "criteria": {f"k{i}": None for i in range(256)}}}),
        "Choice requires between 1 and 255 candidates",
    ),
    (
        "score criteria",
        req(questions={"q": {"type": "score", "instructions": "x", "criteria": {"a": 1}}}),
        "Score requires an array",
    ),
    (
        "score count 1",
        req(questions={"q": {"type": "score", "instructions": "x", "criteria": ["only"]}}),
        "Score requires 2 to 10 descriptive levels",
    ),
    (
        "score count 11",
        req(questions={"q": {"type": "score", "instructions": "x", "criteria": [str(i) for i in range(11)]}}),
        "Score requires 2 to 10 descriptive levels",
    ),
    (
        "noul criteria",
        req(questions={"q": {"type": "noul", "instructions": "x", "criteria": {"true": "y"}}}),
        "Noul criteria must contain true and false descriptions",
    ),
    (
        "type",
        req(questions={"q": {"type": "ranking", "instructions": "x"}}),
        "question type must be choice, score, or noul",
    ),
    (
        "candidate limit",
        req(
            questions={
                f"q{i}": {"type": "choice", "instructions": "x", "criteria": {f"k{j}": None for j in range(255)}}
                for i in range(258)
            }
        ),
        "request exceeds the candidate limit",
    ),
]


@pytest.mark.parametrize("name,body,message", CASES, ids=[c[0] for c in CASES])
def test_validation_message(client, name, body, message):
    with pytest.raises(grpc.RpcError) as caught:
        client.stub.Decide(api.DecideRequest(request_json=json.dumps(body)), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == message


def test_first_error_wins_in_question_order(client):
    body = req(
        questions={
            "first": {"type": "score", "instructions": "x", "criteria": ["one"]},
            "second": {"type": "ranking", "instructions": "x"},
        }
    )
    with pytest.raises(grpc.RpcError) as caught:
        client.stub.Decide(api.DecideRequest(request_json=json.dumps(body)), timeout=30)
    assert caught.value.details() == "Score requires 2 to 10 descriptive levels"


def test_too_long_candidate_is_refused_with_exact_message(client, demo_model):
    from openjev.export import load_export_meta
    from openjev.tokenizer import PromptTokenizer

    meta = load_export_meta(demo_model)
    # "word " is one token per repetition; 17,000 of them exceed max_length=16384.
    state = "word " * 17000
    body = {
        "state": state,
        "questions": {
            "short": {"type": "noul", "instructions": "ok?"},
            "long": {"type": "choice", "instructions": "x", "criteria": {"a": None}},
        },
    }
    # Work out the expected count through the real tokenizer, independently of the server.
    from openjev.contract.request import parse_request

    decision = parse_request(body, accepted_models=meta.accepted_model_names)
    tokenizer = PromptTokenizer.from_export(demo_model)
    n = len(tokenizer.encode([decision.questions[0].prompts[0]])[0])
    assert n > meta.max_length
    with pytest.raises(grpc.RpcError) as caught:
        client.stub.Decide(api.DecideRequest(request_json=json.dumps(body)), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        caught.value.details()
        == f"question short: {n} tokens exceeds max_length={meta.max_length}; no silent truncation"
    )


def test_a_stream_refused_part_way_is_cancelled_not_left_to_the_worker(pair, client):
    """17 candidates go as a stream; the last one too long ends it without a commit. The
    frontend cancels the call then (the worker otherwise waited 50 ms to learn whether its caller
    had gone, on every such refusal), and the worker never runs the request."""
    from openjev.tools.soak import log_events

    criteria = {f"c{i}": None for i in range(16)} | {"long": "word " * 17000}
    body = {"state": STATE, "questions": {"q": {"type": "choice", "instructions": "x", "criteria": criteria}}}
    request_id = "refused-part-way"
    with pytest.raises(grpc.RpcError) as caught:
        client.stub.Decide(
            api.DecideRequest(request_json=json.dumps(body)), timeout=60, metadata=[("x-request-id", request_id)]
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds max_length=16384; no silent truncation" in caught.value.details()
    deadline = time.monotonic() + 10
    while not (
        lines := [e for e in log_events(pair.worker.log_text(), "execute") if e.get("request_id") == request_id]
    ):
        assert time.monotonic() < deadline, "no execute line from the worker"
        time.sleep(0.05)
    assert [(e["status"], e["reason"]) for e in lines] == [("DISCARDED", "client went away before commit")]
