"""The frontend's attempt loop and routes (service.py `_execute`/`_route`, worker_calls.failure),
in process as the HTTP route runs them, in front of a fake worker that follows a script per call:
a call no worker accepted is tried again, three times in all, after a backoff that doubles; a
call the context's worker refused unrun with a full queue goes once more, round-robin; each
request is counted once under the route that answered or failed it. The fake records when each
call came and whether it carried the affinity header (only the ring_hash channel's calls do)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from dataclasses import dataclass

import grpc
import pytest
from fake_worker import fake_describe, serve_fake
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from openjev import abi, metrics
from openjev.export import load_export_meta
from openjev.frontend import routing
from openjev.frontend.http.app import HttpCallContext
from openjev.frontend.service import DecisionServicer, Refused
from openjev.frontend.worker_link import WorkerLink
from openjev.tokenizer import PromptTokenizer
from openjev.tools import launch
from openjev.v1 import decision_pb2 as api
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

# As service.py documents it: the first retry after 50 ms, the second after 100 ms.
FIRST_BACKOFF, SECOND_BACKOFF = 0.05, 0.10
# What a loaded two-core machine may add to a gap (a new attempt tokenizes again, and the link
# describes the workers again); a gap longer than this is not the backoff's.
SLACK = 2.0
STATE = "A customer says: I was charged twice for one order."
FULL = "worker queue is full (0 waiting)"
# openjev_frontend_routed_requests_total's (route, reason) series, as dashboards name them
AFFINITY = ("affinity", "context")
QUEUE_FULL = ("fallback", "queue_full")
NOT_ACCEPTED = ("fallback", "not_accepted")
NOT_REPLAYED = ("affinity", "queue_full_not_replayable")
ROUND_ROBIN = ("round_robin", "affinity_off")


# action: (the status the fake fails the call with, whether it sent the accepted header first)
FAILURES = {
    "unaccepted": (grpc.StatusCode.UNAVAILABLE, False),  # ran nowhere (a worker going away)
    "lost": (grpc.StatusCode.UNAVAILABLE, True),  # lost after it was accepted: it may have run
    "disagrees": (grpc.StatusCode.INVALID_ARGUMENT, False),  # restarted with smaller limits
    "foreign": (grpc.StatusCode.UNIMPLEMENTED, False),  # another server at the worker's address
    "cancelled": (grpc.StatusCode.CANCELLED, False),  # the worker's commit timeout ran out
    "internal": (grpc.StatusCode.NOT_FOUND, True),  # any code not passed through: INTERNAL to the client
    "full": (grpc.StatusCode.RESOURCE_EXHAUSTED, True),  # a full queue, before any result
    "full_after_a_result": (grpc.StatusCode.RESOURCE_EXHAUSTED, True),  # after one question's result
}


@dataclass
class Call:
    at: float  # time.monotonic() when the call reached the fake
    method: str
    affinity_key: str | None  # the x-openjev-affinity header: set on the ring_hash channel only
    deadline: float | None  # the call's deadline as time.monotonic() (fake and frontend share the process)


class Scripted(worker_pb2_grpc.WorkerServiceServicer):
    """A worker whose n-th work call (from 0) does `script(n, call)`: "answer" (well-formed
    results), "past_the_end" (the last question's result under the index after it) or one of
    FAILURES."""

    def __init__(self, describe: wire.DescribeResponse):
        self.describe = describe
        self.script = lambda n, call: "answer"
        self.calls: list[Call] = []
        self.describes = 0
        self._lock = threading.Lock()

    def Describe(self, request, context):
        self.describes += 1
        return self.describe

    def _begin(self, method: str, context) -> tuple[str, Call]:
        key = dict(context.invocation_metadata()).get(routing.AFFINITY_HEADER)
        now, remaining = time.monotonic(), context.time_remaining()
        call = Call(now, method, key, None if remaining is None else now + remaining)
        with self._lock:
            n = len(self.calls)
            self.calls.append(call)
        action = self.script(n, call)
        if action not in FAILURES or FAILURES[action][1]:
            context.send_initial_metadata(((abi.ACCEPTED_METADATA_KEY, "1"),))
        return action, call

    @staticmethod
    def _fail(context, action: str) -> None:
        # not context.abort: the error it raises would be left in a cycle in this process
        code = FAILURES[action][0]
        context.set_code(code)
        context.set_details(FULL if code == grpc.StatusCode.RESOURCE_EXHAUSTED else f"scripted {action}")

    def Execute(self, request_iterator, context):
        action, _ = self._begin("Execute", context)
        header, tokens = None, 0
        for message in request_iterator:  # the whole request first, as a worker admits it at its commit
            if message.WhichOneof("item") == "header":
                header = message.header
            elif message.WhichOneof("item") == "batch":
                tokens += sum(len(c.token_ids) for c in message.batch.candidates)
        if action not in FAILURES:
            questions, summary = _results(header, tokens, action)
            for question in questions:
                yield wire.ExecuteResponse(question=question)
            yield wire.ExecuteResponse(summary=summary)
            return
        if action == "full_after_a_result":
            yield wire.ExecuteResponse(question=_results(header, tokens)[0][0])
        self._fail(context, action)

    def ExecuteUnary(self, request, context):
        action, _ = self._begin("ExecuteUnary", context)
        if action in FAILURES:
            self._fail(context, action)
            return wire.ExecuteUnaryResponse()
        questions, summary = _results(request.header, sum(len(c.token_ids) for c in request.candidates), action)
        return wire.ExecuteUnaryResponse(questions=questions, summary=summary)


def _results(
    header: wire.ExecuteHeader, tokens: int, action: str = "answer"
) -> tuple[list[wire.QuestionResult], wire.ExecutionSummary]:
    sizes = [2 if q.kind == wire.QUESTION_KIND_NOUL else q.num_candidates for q in header.questions]
    questions = [wire.QuestionResult(question_index=i, probabilities=[1.0 / s] * s) for i, s in enumerate(sizes)]
    if action == "past_the_end":
        questions[-1].question_index = len(questions)
    off, none = abi.policy_to_enum("off"), abi.scope_to_enum("none")
    summary = wire.ExecutionSummary(
        policy=off, executed_policy=off, scope=none, submitted_tokens=tokens, computed_tokens=tokens
    )
    return questions, summary


@contextlib.contextmanager
def _frontend(demo_model, affinity: bool, execute_unary: bool):
    """(fake worker, DecisionServicer in this process linked to it with or without affinity)."""
    fake = Scripted(fake_describe(demo_model, execute_unary))
    server, port = serve_fake(fake)
    meta = load_export_meta(demo_model)
    tokenizer = PromptTokenizer.from_export(demo_model)
    link = WorkerLink(
        f"127.0.0.1:{port}",
        fingerprint=tokenizer.fingerprint,
        max_length=meta.max_length,
        model_id=meta.model_id,
        temperature=meta.temperature,
        refresh_seconds=600,  # describes again only when a call is refused (refresh_soon)
        affinity=affinity,
    )
    link.start()
    servicer = DecisionServicer(meta, tokenizer, link)
    try:
        deadline = time.monotonic() + 30
        while link.state.problem is not None:
            assert time.monotonic() < deadline, link.state.problem
            time.sleep(0.05)
        yield fake, servicer
    finally:
        servicer.close()
        link.close()
        server.stop(0)


@pytest.fixture(
    scope="module",
    params=[(True, False), (True, True), (False, False)],
    ids=["affinity-Execute", "affinity-ExecuteUnary", "round_robin-Execute"],
)
def frontend(request, demo_model):
    affinity, execute_unary = request.param
    with _frontend(demo_model, affinity, execute_unary) as (fake, servicer):
        yield fake, servicer, affinity, "ExecuteUnary" if execute_unary else "Execute"


def _body(questions: int = 1) -> str:
    return json.dumps(
        {"state": STATE, "questions": {f"q{i}": {"type": "noul", "instructions": "Refund?"} for i in range(questions)}}
    )


def _decide(servicer: DecisionServicer, request_id: str, timeout: float | None = 30.0, questions: int = 1):
    """The answer, or the Refused the caller's status comes from."""
    deadline = None if timeout is None else time.monotonic() + timeout
    context = HttpCallContext(request_id, deadline)
    try:
        return servicer.answer(api.DecideRequest(request_json=_body(questions)), context, request_id, {})
    except Refused as refused:
        return refused


def _routed() -> dict[tuple[str, str], float]:
    return {
        (s.labels["route"], s.labels["reason"]): s.value
        for family in metrics.frontend_registry.collect()
        for s in family.samples
        if s.name == "openjev_frontend_routed_requests_total"
    }


def _counted(run) -> tuple[object, dict[tuple[str, str], float]]:
    """run()'s result, and the routes its request was counted under (only those that moved)."""
    before = _routed()
    result = run()
    after = _routed()
    return result, {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _script(fake: Scripted, *actions: str) -> None:
    """The next calls do `actions` in turn (the last one again after them)."""
    fake.calls = []
    fake.script = lambda n, call: actions[min(n, len(actions) - 1)]


def test_an_unaccepted_call_is_tried_three_times_in_all_after_a_doubling_backoff(frontend):
    fake, servicer, affinity, method = frontend
    _script(fake, "unaccepted")
    refused, counted = _counted(lambda: _decide(servicer, "never-accepted"))
    assert isinstance(refused, Refused) and refused.code == grpc.StatusCode.UNAVAILABLE, refused
    assert refused.message == "worker: scripted unaccepted"
    assert [c.method for c in fake.calls] == [method] * 3
    at = [c.at for c in fake.calls]
    first, second = at[1] - at[0], at[2] - at[1]
    assert FIRST_BACKOFF <= first < FIRST_BACKOFF + SLACK, first
    assert SECOND_BACKOFF <= second < SECOND_BACKOFF + SLACK, second
    # the ring would pick the same worker again: with affinity the retries go round-robin
    key = routing.affinity_key(STATE) if affinity else None
    assert [c.affinity_key for c in fake.calls] == [key, None, None]
    assert counted == {NOT_ACCEPTED if affinity else ROUND_ROBIN: 1}


def test_the_third_attempt_may_answer(frontend):
    fake, servicer, affinity, method = frontend
    _script(fake, "unaccepted", "unaccepted", "answer")
    response, counted = _counted(lambda: _decide(servicer, "third-time", questions=2))
    assert isinstance(response, api.DecideResponse), response
    assert [a.question_id for a in response.answers] == ["q0", "q1"]
    assert len(fake.calls) == 3
    assert counted == {NOT_ACCEPTED if affinity else ROUND_ROBIN: 1}


def test_an_answered_request_is_counted_under_its_route(frontend):
    fake, servicer, affinity, method = frontend
    _script(fake, "answer")
    response, counted = _counted(lambda: _decide(servicer, "answered"))
    assert isinstance(response, api.DecideResponse), response
    assert [(c.method, c.affinity_key) for c in fake.calls] == [
        (method, routing.affinity_key(STATE) if affinity else None)
    ]
    assert counted == {AFFINITY if affinity else ROUND_ROBIN: 1}


@pytest.mark.parametrize("action", ["internal", "full_after_a_result"])
def test_a_call_the_worker_accepted_and_failed_is_not_tried_again(frontend, action):
    fake, servicer, affinity, method = frontend
    if action == "full_after_a_result" and method == "ExecuteUnary":
        pytest.skip("a unary reply is all or nothing")
    _script(fake, action, "answer")
    refused, counted = _counted(lambda: _decide(servicer, f"accepted-{action}", questions=2))
    expected = grpc.StatusCode.INTERNAL if action == "internal" else grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(refused, Refused) and refused.code == expected, refused
    assert len(fake.calls) == 1  # it may have run: never sent again
    assert counted == {AFFINITY if affinity else ROUND_ROBIN: 1}


def test_a_full_queue_at_the_contexts_worker_goes_once_more_round_robin(frontend):
    fake, servicer, affinity, method = frontend
    if not affinity:
        pytest.skip("no other route without affinity (test_a_request_full_on_both_routes_...)")
    # the context's worker (the ring_hash channel's call) is full; a round-robin call answers
    fake.calls = []
    fake.script = lambda n, call: "full" if call.affinity_key else "answer"
    result, counted = _counted(lambda: _decide(servicer, "queue-full"))
    assert isinstance(result, api.DecideResponse), result
    assert [(c.method, c.affinity_key) for c in fake.calls] == [(method, routing.affinity_key(STATE)), (method, None)]
    assert counted == {QUEUE_FULL: 1}


def test_a_request_full_on_both_routes_is_refused_after_two_calls(frontend):
    fake, servicer, affinity, method = frontend
    _script(fake, "full")
    refused, counted = _counted(lambda: _decide(servicer, "full-twice"))
    assert isinstance(refused, Refused) and refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert refused.message == f"worker: {FULL}"
    # the full worker is not asked a third time, nor is the full queue retried as unaccepted
    assert [c.affinity_key for c in fake.calls] == ([routing.affinity_key(STATE), None] if affinity else [None])
    assert counted == {QUEUE_FULL if affinity else ROUND_ROBIN: 1}


def test_an_unaccepted_resend_after_a_full_queue_is_retried_round_robin_and_counted_once(frontend):
    fake, servicer, affinity, method = frontend
    if not affinity:
        pytest.skip("no resend without affinity")
    _script(fake, "full", "unaccepted", "answer")
    response, counted = _counted(lambda: _decide(servicer, "full-then-unaccepted"))
    assert isinstance(response, api.DecideResponse), response
    assert [c.affinity_key for c in fake.calls] == [routing.affinity_key(STATE), None, None]
    assert counted == {QUEUE_FULL: 1}


def test_a_full_queue_with_the_replay_budget_spent_is_not_sent_again(demo_model):
    """A stream's messages are kept for the resend within a budget all requests share; one that
    finds it spent (other requests hold it) gets the full queue, counted as not replayed."""
    with _frontend(demo_model, affinity=True, execute_unary=False) as (fake, servicer):
        assert servicer._replay_budget.take(routing.REPLAY_TOTAL_BYTES)  # held by the others
        _script(fake, "full", "answer")
        refused, counted = _counted(lambda: _decide(servicer, "not-replayed"))
    assert isinstance(refused, Refused) and refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert len(fake.calls) == 1
    assert counted == {NOT_REPLAYED: 1}


def test_every_attempt_runs_within_the_requests_one_deadline(frontend):
    fake, servicer, affinity, method = frontend

    def slow_then_answer(n, call):
        if n == 0:
            time.sleep(1.0)  # the retries have that much less time
        return "unaccepted" if n < 2 else "answer"

    fake.calls, fake.script = [], slow_then_answer
    # under 10 s: gRPC sends a longer timeout rounded up to as much as a second
    deadline = time.monotonic() + 5.0
    response = _decide(servicer, "one-deadline", timeout=deadline - time.monotonic())
    assert isinstance(response, api.DecideResponse), response
    assert len(fake.calls) == 3
    assert all(abs(c.deadline - deadline) < 0.3 for c in fake.calls), [c.deadline - deadline for c in fake.calls]


def test_no_retry_when_less_time_is_left_than_the_backoff(frontend):
    """The worker refuses the call unaccepted with less than the first backoff left of the
    deadline: the request ends then, not after a sleep and an attempt that cannot run."""
    fake, servicer, affinity, method = frontend

    def late(n, call):
        time.sleep(max(0.0, deadline - time.monotonic() - FIRST_BACKOFF / 2))
        return "unaccepted"

    fake.calls, fake.script = [], late
    deadline = time.monotonic() + 1.0
    with capture_logs() as logs:
        refused = _decide(servicer, "no-time-left", timeout=deadline - time.monotonic())
    # UNAVAILABLE, or DEADLINE_EXCEEDED where the refusal came after the deadline on a loaded machine
    assert isinstance(refused, Refused), refused
    assert refused.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), refused
    assert len(fake.calls) == 1
    assert [e for e in logs if e["event"] == "worker_retry"] == []


@pytest.mark.parametrize(
    ("action", "code", "calls"),
    [
        ("lost", grpc.StatusCode.UNAVAILABLE, 1),
        ("disagrees", grpc.StatusCode.INTERNAL, 3),
        ("foreign", grpc.StatusCode.UNAVAILABLE, 3),
        ("cancelled", grpc.StatusCode.UNAVAILABLE, 3),
    ],
)
def test_only_a_call_no_worker_accepted_is_tried_again(frontend, action, code, calls):
    fake, servicer, affinity, method = frontend
    if action == "foreign" and method == "ExecuteUnary":
        pytest.skip("UNIMPLEMENTED ExecuteUnary: a worker without it, sent the stream instead (test_execute_unary.py)")
    _script(fake, action)
    describes = fake.describes
    refused = _decide(servicer, f"which-{action}")
    assert isinstance(refused, Refused) and refused.code == code, refused
    assert len(fake.calls) == calls
    if calls > 1:  # the workers are described again at once (the link's period here is 600 s)
        deadline = time.monotonic() + 10
        while fake.describes == describes:
            assert time.monotonic() < deadline, "no Describe after a call no worker accepted"
            time.sleep(0.05)
    if action == "cancelled":  # the client, still there, cancelled nothing
        assert "commit timeout" in refused.message


def test_every_route_is_a_series_at_0_before_the_first_request(demo_model, tmp_path):
    """A rate over a route (a dashboard's share of fallbacks) exists before its first request."""
    server, port = serve_fake(Scripted(fake_describe(demo_model)))
    metrics_port = launch.free_port()
    frontend = launch.start_frontend(
        demo_model, f"127.0.0.1:{port}", tmp_path, ["--worker-affinity", "on", "--metrics-port", str(metrics_port)]
    )
    try:
        launch.wait_serving(frontend.address)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    finally:
        frontend.stop()
        server.stop(0)
    routes = {
        (s.labels["route"], s.labels["reason"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "openjev_frontend_routed_requests_total"
    }
    assert routes == {AFFINITY: 0, QUEUE_FULL: 0, NOT_ACCEPTED: 0, NOT_REPLAYED: 0, ROUND_ROBIN: 0}


def test_a_replay_keeps_a_request_of_exactly_its_limits():
    """The request's own limit and the shared budget both hold a request of just their size."""
    assert (routing.REPLAY_REQUEST_BYTES, routing.REPLAY_TOTAL_BYTES) == (16 << 20, 256 << 20)  # as documented
    header = wire.ExecuteRequest(header=wire.ExecuteHeader(request_id="r"))
    batch = wire.ExecuteRequest()
    batch.batch.candidates.add(question_index=0, candidate_index=0, token_ids=list(range(100)))
    sent = [header, batch, wire.ExecuteRequest(commit=wire.Commit())]
    size = sum(m.ByteSize() for m in sent)
    budget = routing.ReplayBudget(size)
    replay = routing.Replay(iter(sent), size, budget)
    assert list(replay) == sent and replay.replayable
    assert list(replay.again()) == sent
    assert not budget.take(1)  # all of it held, until the request ends
    replay.close()
    assert budget.take(size)
    budget.give(size)
    for max_bytes, budget_bytes in ((size - 1, size), (size, size - 1)):  # a byte short of either: not kept
        short = routing.Replay(iter(sent), max_bytes, routing.ReplayBudget(budget_bytes))
        assert list(short) == sent and not short.replayable


def test_a_result_for_the_question_after_the_last_is_internal(frontend):
    fake, servicer, affinity, method = frontend
    _script(fake, "past_the_end")
    refused = _decide(servicer, "past-the-end", questions=2)
    assert isinstance(refused, Refused) and refused.code == grpc.StatusCode.INTERNAL, refused
    assert refused.message == "worker returned question 2 twice or out of range"
    assert len(fake.calls) == 1
