"""Hostile input through the real gRPC API (real frontend + worker on loopback).

Every request hypothesis makes (deep and wide JSON, unicode and lone surrogates, huge strings,
empty and duplicate ids, counts around every limit, non-finite numbers, unknown enum values)
gets a well-formed answer or INVALID_ARGUMENT with a contract message: never INTERNAL, another
status, a crash or a hang; and a valid request sent after each one still gets the same answer.
Bytes that are no DecideRequest, and messages over the size limit, get clear errors too."""

from __future__ import annotations

import json
import math
import re
import time

import grpc
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis_profiles import HYPOTHESIS

from openjev import serving
from openjev.contract import errors
from openjev.tools.soak import comparable
from openjev.v1 import decision_pb2 as api

CONTRACT_MESSAGES = {v for k, v in vars(errors).items() if k.isupper() and isinstance(v, str)}
TOO_LONG = re.compile(r"question .*: \d+ tokens exceeds max_length=16384; no silent truncation", re.S)
CANARY = {
    "state": "A customer says: I was charged twice for one order.",
    "questions": {
        "route": {
            "type": "choice",
            "instructions": "Which team?",
            "criteria": {"billing": "Charges.", "security": None},
        },
        "urgent": {"type": "noul", "instructions": "Is it urgent?"},
        "level": {"type": "score", "instructions": "Severity?", "criteria": ["low", "mid", "high"]},
    },
}

# -- strategies -------------------------------------------------------------------------------

surrogates = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udc00"])  # lone and paired-but-escaped
texts = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(codec="utf-8"), max_size=200),
    surrogates,
    st.sampled_from(["", " ", "<|im_end|>", "<|im_start|>assistant\n", "\x00\x1f", "人力资源管理", "🙂" * 30]),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**63, max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(texts, inner, max_size=6)),
    max_leaves=25,
)
deep = st.integers(min_value=100, max_value=200).map(lambda n: "[" * n + "]" * n)  # around the 127 limit
wide = st.integers(min_value=50, max_value=400).map(lambda n: {f"k{i}": [i, str(i)] for i in range(n)})
huge = st.sampled_from([17000, 40000]).map(lambda n: "word " * n)  # more tokens than max_length
descriptions = st.one_of(texts, json_values)
ABSENT = object()


@st.composite
def criteria(draw, kind):
    if kind == "choice":
        n = draw(st.sampled_from([0, 1, 2, 3, 5, 255, 256]))
        return draw(
            st.one_of(
                st.just({f"c{i}": None for i in range(n)}),
                st.dictionaries(texts, st.one_of(st.none(), descriptions), min_size=0, max_size=4),
                json_values,
            )
        )
    if kind == "score":
        n = draw(st.sampled_from([0, 1, 2, 3, 10, 11]))
        return draw(
            st.one_of(st.just([f"level {i}" for i in range(n)]), st.lists(descriptions, max_size=11), json_values)
        )
    return draw(
        st.one_of(
            st.none(),
            st.fixed_dictionaries({"true": descriptions, "false": descriptions}),
            st.dictionaries(texts, descriptions, max_size=3),
            json_values,
        )
    )


@st.composite
def question(draw):
    kind = draw(st.one_of(st.sampled_from(["choice", "score", "noul"]), texts, st.integers(), st.none()))
    body = {}
    if draw(st.integers(0, 9)):  # sometimes no type at all
        body["type"] = kind
    body["instructions"] = draw(st.one_of(texts, descriptions))
    if draw(st.integers(0, 4)):
        body["criteria"] = draw(criteria(kind if kind in ("choice", "score", "noul") else "noul"))
    if not draw(st.integers(0, 15)):
        return draw(json_values)  # not a question object at all
    return body


@st.composite
def requests(draw):
    """(request JSON text, gRPC prefix_policy enum value)."""
    body = {}
    model = draw(st.sampled_from([ABSENT, None, "open-jev", "jev-latest", "open-jev-demo", "other", 3]))
    if model is not ABSENT:
        body["model"] = model
    state = draw(st.one_of(texts, json_values, deep, wide, huge, st.just(ABSENT), st.none()))
    if state is not ABSENT:
        body["state"] = state
    questions = draw(st.one_of(st.dictionaries(texts, question(), min_size=1, max_size=4), st.just({}), json_values))
    body["questions"] = questions
    policy = draw(st.sampled_from([ABSENT, None, "off", "auto", "shared", "fixed", "default", "bogus", 1]))
    if policy is not ABSENT:
        body["prefix_policy"] = policy
    ensure_ascii = draw(st.booleans())
    text = json.dumps(body, ensure_ascii=ensure_ascii)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate can only travel escaped
        text = json.dumps(body, ensure_ascii=True)
    mutation = draw(st.sampled_from(["none"] * 6 + ["duplicate_id", "truncate", "insert", "wrap"]))
    if mutation == "duplicate_id" and isinstance(questions, dict) and questions:
        qid, definition = next(iter(questions.items()))
        entry = json.dumps({qid: definition})[1:-1]
        text = text.replace('"questions": {', '"questions": {' + entry + ", ", 1)
    elif mutation == "truncate":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    elif mutation == "insert":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["\x00", "}", "\\", '"', "\ufeff", "NaN", ",", "1e400"])) + text[at:]
    elif mutation == "wrap":
        text = "\ufeff" + text if draw(st.booleans()) else "[" + text + "]"
    enum = draw(st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5]), st.integers(min_value=-(2**31), max_value=2**31 - 1)))
    return text, enum


# -- checks -----------------------------------------------------------------------------------


def check_outcome(client, text: str, enum: int) -> str:
    started = time.monotonic()
    try:
        response = client.stub.Decide(api.DecideRequest(request_json=text, prefix_policy=enum), timeout=60)
    except grpc.RpcError as error:
        assert time.monotonic() - started < 30, "hostile request took too long"
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details(), text[:300])
        assert error.details() in CONTRACT_MESSAGES or TOO_LONG.fullmatch(error.details()), error.details()
        return error.details()
    body = json.loads(text)  # accepted: it was a valid request, and its answer must be well-formed
    assert [a.question_id for a in response.answers] == list(body["questions"])
    for answer in response.answers:
        values = list(answer.probabilities) if answer.WhichOneof("kind") != "noul" else [answer.noul.noul]
        assert all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in values)
        if answer.WhichOneof("kind") != "noul":
            assert math.isclose(sum(values), 1.0, abs_tol=1e-9)
    return "OK"


@pytest.fixture(scope="module")
def canary(client):
    answer = comparable(client.decide(CANARY, policy="off", timeout=60))

    def check() -> None:
        assert comparable(client.decide(CANARY, policy="off", timeout=60)) == answer

    return check


@HYPOTHESIS
@given(requests())
def test_hostile_requests_get_an_answer_or_a_contract_error(client, canary, request_and_enum):
    text, enum = request_and_enum
    event(check_outcome(client, text, enum)[:40])
    canary()  # the servers still answer a valid request, with the same answer


@pytest.mark.parametrize(
    "name,text,enum,message",
    [
        ("unknown policy enum", json.dumps(CANARY), 99, errors.PREFIX_POLICY),
        ("negative policy enum", json.dumps(CANARY), -7, errors.PREFIX_POLICY),
        (
            "nesting 10,000 deep",
            '{"state": ' + "[" * 10000 + "]" * 10000 + ', "questions": {}}',
            0,
            errors.INVALID_JSON,
        ),
        ("nesting 128 deep", '{"state": ' + "[" * 127 + "]" * 127 + ', "questions": {}}', 0, errors.INVALID_JSON),
        ("1e400", '{"state": 1e400, "questions": {}}', 0, errors.INVALID_JSON),
        ("lone surrogate", '{"state": "\\ud800", "questions": {}}', 0, errors.INVALID_JSON),
        ("BOM", "\ufeff" + json.dumps(CANARY), 0, errors.INVALID_JSON),
        ("empty body", "", 0, errors.INVALID_JSON),
        (
            "duplicate ids",
            '{"state": "x", "questions": {"a": {"type": "noul", "instructions": "x"}, '
            '"a": {"type": "noul", "instructions": "y"}}}',
            0,
            errors.INVALID_JSON,
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None,
)
def test_named_hostile_cases(client, canary, name, text, enum, message):
    with pytest.raises(grpc.RpcError) as caught:
        client.stub.Decide(api.DecideRequest(request_json=text, prefix_policy=enum), timeout=30)
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    canary()


@pytest.mark.parametrize("question_id", ["q" * 20000, "问" * 2000], ids=["ascii", "cjk"])
def test_a_long_question_id_in_a_too_long_refusal_is_cut(client, question_id):
    """The whole id went into the max_length message, which gRPC sends in a header of at most
    16 KiB: the refusal came back RESOURCE_EXHAUSTED ("retry later") on gRPC, 422 over HTTP."""
    body = {"state": "word " * 17000, "questions": {question_id: {"type": "noul", "instructions": "x"}}}
    with pytest.raises(grpc.RpcError) as caught:
        client.decide(body, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    cut = question_id[: errors.MAX_ID_CHARS_IN_MESSAGE] + "..."
    assert TOO_LONG.fullmatch(caught.value.details()) and caught.value.details().startswith(f"question {cut}: ")


def test_a_lone_surrogate_in_a_client_dict_is_refused_by_the_server(client):
    """Client.decide failed to encode the text itself (UnicodeEncodeError) instead of sending it
    for the contract's refusal, as a JSON body with the same escape gets over HTTP."""
    with pytest.raises(grpc.RpcError) as caught:
        client.decide({"state": "\ud800", "questions": {"q": {"type": "noul", "instructions": "x"}}}, timeout=30)
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, errors.INVALID_JSON)


def test_empty_question_id_and_deep_but_legal_state_are_answered(client):
    state = "[" * 126 + "]" * 126  # the body object + 126 arrays = 127 containers: the limit
    response = client.decide({"state": state, "questions": {"": {"type": "noul", "instructions": "?"}}}, timeout=60)
    assert list(response["answers"]) == [""]


def raw_decide(address: str, max_send: int = serving.MAX_MESSAGE_BYTES):
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", max_send)])
    return channel, channel.unary_unary(
        "/openjev.v1.DecisionService/Decide", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )


@pytest.mark.parametrize(
    "payload",
    [b"\xff\xff\xff\xff", b"\x0a\x03\xff\xfe\x41", b"\x0a\x10abc"],
    ids=["garbage", "string not utf-8", "length past end"],
)
def test_bytes_that_are_no_request_are_invalid_argument(pair, canary, payload):
    channel, decide = raw_decide(pair.frontend.address)
    with channel, pytest.raises(grpc.RpcError) as caught:
        decide(payload, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request message" in caught.value.details()
    canary()


def test_unknown_fields_are_ignored(pair):
    channel, decide = raw_decide(pair.frontend.address)
    payload = api.DecideRequest(request_json=json.dumps(CANARY)).SerializeToString() + b"\xa0\x06\x01"  # field 100
    with channel:
        reply = api.DecideResponse.FromString(decide(payload, timeout=30))
    assert [a.question_id for a in reply.answers] == list(CANARY["questions"])


def test_message_size_limit_on_both_servers(pair, canary):
    """Over 64 MiB: RESOURCE_EXHAUSTED from gRPC naming both sizes, before any servicer runs; the
    server is unaffected. The worker has the same limit on its own port."""
    limit = serving.MAX_MESSAGE_BYTES
    oversized = api.DecideRequest(
        request_json=json.dumps({"state": "a" * (limit + 1024), "questions": {}})
    ).SerializeToString()
    channel, decide = raw_decide(pair.frontend.address, max_send=2 * limit)
    with channel, pytest.raises(grpc.RpcError) as caught:
        decide(oversized, timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"larger than max ({len(oversized)} vs. {limit})" in caught.value.details()
    worker = grpc.insecure_channel(pair.worker.address, options=[("grpc.max_send_message_length", 2 * limit)])
    execute = worker.stream_stream(
        "/openjev.worker.v1.WorkerService/Execute", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    with worker, pytest.raises(grpc.RpcError) as caught:
        list(execute(iter([b"\x0a" + b"\x00" * (limit + 16)]), timeout=30))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"vs. {limit})" in caught.value.details()
    # The public client refuses to send one at all, with the same clear status.
    with pytest.raises(grpc.RpcError) as caught:
        pair_client_decide(pair, oversized)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    canary()


def pair_client_decide(pair, payload: bytes):
    from openjev.client import Client

    with Client(pair.frontend.address) as c:
        return c.stub.Decide(api.DecideRequest.FromString(payload), timeout=30)


def test_largest_valid_request_is_answered(client):
    """65,536 candidates (4,096 questions of 16): the limit itself is a valid request."""
    body = {
        "state": "x",
        "questions": {
            f"q{i}": {"type": "choice", "instructions": "i", "criteria": {f"c{j}": None for j in range(16)}}
            for i in range(4096)
        },
    }
    response = client.decide(body, policy="shared", timeout=120)
    assert len(response["answers"]) == 4096 and response["metadata"]["candidate_sequences"] == 65536
