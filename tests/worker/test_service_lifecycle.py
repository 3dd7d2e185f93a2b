"""The worker's servicer (openjev.worker.service) and its held-token budget: what a mutation
review of its request lifecycle found no test pinning. A real worker on loopback, or, where a
request must be held mid-pass or fail, a servicer over a real engine served in this process
with a runner that waits for the test (or reads a non-finite score).

The held-token budget is given back before the answer is sent (its ids are spent by then), so
a client slow to read its answer keeps no budget from the next request. The answer of these
tests fits gRPC's default flow-control window, so the order only shows with a client whose
window is smaller than its answer: the worker's send then waits until the client reads."""

from __future__ import annotations

import threading
import time
import urllib.request
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest
from held_gauge import wait_held
from structlog.testing import capture_logs

from openjev import abi, interceptors, tracing
from openjev.tools import launch
from openjev.tools.soak import log_events
from openjev.v1 import decision_pb2 as api
from openjev.worker.engine import Engine
from openjev.worker.runner_api import SegmentResult
from openjev.worker.service import CACHE_HIT_TOKENS_KEY, WorkerIdentity, WorkerServicer
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

MAX_REQUEST_TOKENS = 4000
MAX_HELD_TOKENS = 6000
# long enough for every stream here to commit, short enough for a test to outlive
COMMIT_TIMEOUT_SECONDS = 4.0
# a receive window of 1 KiB and no BDP probe to grow it: a 255-candidate answer (~3 KiB) waits
SLOW_READER = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def worker(demo_model, tmp_path_factory):
    metrics_port = launch.free_port()
    process = launch.start_worker(
        demo_model,
        tmp_path_factory.mktemp("service"),
        [
            *("--max-request-tokens", str(MAX_REQUEST_TOKENS), "--max-held-tokens", str(MAX_HELD_TOKENS)),
            *("--metrics-port", str(metrics_port), "--state-cache-bytes", "0"),
            *("--commit-timeout-seconds", str(COMMIT_TIMEOUT_SECONDS)),
        ],
    )
    process.metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stub(worker):
    with grpc.insecure_channel(worker.address) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel)


def choice(num_candidates: int, tokens_each: int) -> tuple[wire.ExecuteHeader, list[wire.Candidate]]:
    header = wire.ExecuteHeader(
        questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_CHOICE, num_candidates=num_candidates)]
    )
    candidates = [
        wire.Candidate(
            question_index=0, candidate_index=i, token_ids=[1000 + (7 * i + j) % 3000 for j in range(tokens_each)]
        )
        for i in range(num_candidates)
    ]
    return header, candidates


def stream(header: wire.ExecuteHeader, candidates: list[wire.Candidate], per_message: int = 16):
    yield wire.ExecuteRequest(header=header)
    for start in range(0, len(candidates), per_message):
        yield wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=candidates[start : start + per_message]))
    yield wire.ExecuteRequest(commit=wire.Commit())


def test_an_answer_not_read_yet_holds_no_budget(worker, stub):
    """255 candidates of 15 tokens (3,825 held while it arrives and runs); its client reads
    nothing. Once it ran, its tokens are back: a request of 4,000 (past the 2,175 left were
    they still held) is answered while the first answer still waits to be read. Read after the
    commit timeout has passed, the answer is whole: the commit stopped the stream's timer."""
    header, candidates = choice(255, 15)
    with grpc.insecure_channel(worker.address, options=SLOW_READER) as channel:
        started = time.monotonic()
        slow = worker_pb2_grpc.WorkerServiceStub(channel).Execute(stream(header, candidates), timeout=60)
        try:
            # accepted (a frontend no longer sends it elsewhere): held from here until it has run
            assert (abi.ACCEPTED_METADATA_KEY, "1") in slow.initial_metadata()
            wait_held(worker.metrics, 0)
            header, candidates = choice(2, 2000)
            answer = stub.ExecuteUnary(wire.ExecuteUnaryRequest(header=header, candidates=candidates), timeout=60)
            assert len(answer.questions[0].probabilities) == 2
            # the call outlives the commit timeout (not what is asserted: what the answer must survive)
            time.sleep(max(0.0, started + COMMIT_TIMEOUT_SECONDS + 0.5 - time.monotonic()))
            replies = list(slow)  # read at last: the whole answer
            assert len(replies[0].question.probabilities) == 255 and replies[-1].HasField("summary")
        finally:
            slow.cancel()


def execute_line(worker, request_id: str, timeout: float = 10.0) -> dict:
    """The worker's `execute` log line of one call (written as the call ends)."""
    deadline = time.monotonic() + timeout
    while not (lines := [e for e in log_events(worker.log_text(), "execute") if e.get("request_id") == request_id]):
        assert time.monotonic() < deadline, f"no execute line for {request_id}"
        time.sleep(0.05)
    assert len(lines) == 1, lines
    return lines[0]


def test_the_summary_and_the_log_line_tell_the_same_figures(worker, stub):
    """Auto: the summary names the policy asked for and the one that ran (a frontend reports the
    first as metadata.prefix_cache.policy); the `execute` line and the trailing cache hits give the
    figures the summary gives, each from its own field of the result."""
    prefix = [1000 + j for j in range(60)]  # a shared prefix: something to save
    header = wire.ExecuteHeader(
        prefix_policy=api.PREFIX_POLICY_AUTO,
        questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_CHOICE, num_candidates=3)],
    )
    candidates = [wire.Candidate(question_index=0, candidate_index=i, token_ids=[*prefix, 2000 + i]) for i in range(3)]
    answer, call = stub.ExecuteUnary.with_call(
        wire.ExecuteUnaryRequest(header=header, candidates=candidates),
        metadata=[("x-request-id", "figures")],
        timeout=60,
    )
    summary = answer.summary
    assert summary.policy == api.PREFIX_POLICY_AUTO
    assert abi.policy_from_enum(summary.executed_policy) in ("off", "default", "shared")
    assert summary.submitted_tokens == 3 * 61
    line = execute_line(worker, "figures")
    assert line["status"] == "OK" and line["policy"] == abi.policy_from_enum(summary.executed_policy)
    reported = (summary.submitted_tokens, summary.computed_tokens, summary.saved_tokens, summary.num_launches)
    assert (line["tokens_submitted"], line["tokens_computed"], line["saved_tokens"], line["passes"]) == reported
    assert line["queue_ms"] == round(summary.queue_seconds * 1e3, 3)
    assert int(dict(call.trailing_metadata())[CACHE_HIT_TOKENS_KEY]) == line["cache_hit_tokens"]


def test_a_request_refused_for_the_budget_is_logged_with_its_shape(worker, stub):
    """A stream holds 3,000 tokens uncommitted (1,000 more may come); an ExecuteUnary of three
    candidates and 2,500 tokens would pass the 6,000: its refusal is logged with its header's
    questions and candidates, read before the budget refused it. One past the per-request token
    limit as well is INVALID_ARGUMENT: its own fault comes before the worker's load. The stream
    itself is cancelled by the worker at the commit timeout."""
    header, candidates = choice(2, 3000)

    def uncommitted():
        yield wire.ExecuteRequest(header=header)
        yield wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=candidates[:1]))
        ended.wait(60)

    ended = threading.Event()
    blocker = stub.Execute(uncommitted(), timeout=60)
    try:
        wait_held(worker.metrics, 3000)
        header3, candidates3 = choice(3, 833)
        candidates3[2].token_ids.append(1)  # 2,500 in all
        with pytest.raises(grpc.RpcError) as refused:
            stub.ExecuteUnary(
                wire.ExecuteUnaryRequest(header=header3, candidates=candidates3),
                metadata=[("x-request-id", "over-budget")],
                timeout=60,
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        header2, candidates2 = choice(2, 2000)
        candidates2[1].token_ids.append(1)  # 4,001: its second candidate passes the limit and the budget
        with pytest.raises(grpc.RpcError) as refused:
            stub.ExecuteUnary(wire.ExecuteUnaryRequest(header=header2, candidates=candidates2), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "malformed execute request: request exceeds the worker's limit of 4000 tokens"
        with pytest.raises(grpc.RpcError) as timed_out:
            list(blocker)
        assert timed_out.value.code() == grpc.StatusCode.CANCELLED  # the timer's cancel: what reaches the caller
    finally:
        blocker.cancel()
        ended.set()
    line = execute_line(worker, "over-budget")
    assert (line["status"], line["questions"], line["candidates"], line["kinds"]) == (
        "RESOURCE_EXHAUSTED",
        1,
        3,
        ["choice"],
    )
    wait_held(worker.metrics, 0)


def test_the_fleet_digest_of_an_older_frontend_is_still_this_worker(stub):
    """A frontend from before the weights fingerprint sends the fleet digest without it: the
    worker still answers it; a digest of another revision is UNAVAILABLE, unaccepted."""
    described = stub.Describe(wire.DescribeRequest(), timeout=30)
    revision, policy = described.checkpoint_revision, described.default_prefix_policy
    header, candidates = choice(2, 5)
    request = wire.ExecuteUnaryRequest(header=header, candidates=candidates)
    for fleet in (
        abi.expected_fleet(revision, policy, described.weights_fingerprint),
        abi.expected_fleet(revision, policy),
    ):
        answer = stub.ExecuteUnary(request, metadata=[(abi.EXPECT_FLEET_METADATA_KEY, fleet)], timeout=30)
        assert len(answer.questions[0].probabilities) == 2
    other = abi.expected_fleet(revision + "-other", policy, described.weights_fingerprint)
    with pytest.raises(grpc.RpcError) as refused:
        stub.ExecuteUnary(request, metadata=[(abi.EXPECT_FLEET_METADATA_KEY, other)], timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details() == (
        "this worker is not the one the frontend described "
        "(another checkpoint revision, default prefix policy, config or head)"
    )
    assert abi.ACCEPTED_METADATA_KEY not in dict(refused.value.initial_metadata())


def test_describe_states_the_unary_call_and_the_token_limit(stub):
    """What a frontend plans its calls by: ExecuteUnary is served (else it streams every
    request), and the per-request token limit of --max-request-tokens."""
    described = stub.Describe(wire.DescribeRequest(), timeout=30)
    assert described.execute_unary
    assert described.limits.max_request_tokens == MAX_REQUEST_TOKENS


class _GatedRunner:
    """A runner whose passes wait for `go` (the fault that keeps the engine busy) and read
    `score` as every head score."""

    backend = "torch"

    def __init__(self, score: float = 0.0):
        self.running, self.go = threading.Event(), threading.Event()
        self.score = score

    def run_launch(self, runs):
        self.running.set()
        assert self.go.wait(30)
        return [SegmentResult(object() if r.keep_state else None, self.score if r.read_head else None) for r in runs]


@contextmanager
def in_process(runner: _GatedRunner, queue_capacity: int = 4, observed: bool = False, **servicer_args):
    """A servicer over a real engine and `runner`, served on loopback in this process (observed:
    behind the request interceptor, which gives each call its outcome)."""
    identity = WorkerIdentity(
        "m", None, "r", 1.0, 64, 1000, "fp", "wfp", "torch", "off", 4, 64, 16, 16, 4096, queue_capacity
    )
    servicer = WorkerServicer(Engine(runner, queue_capacity=queue_capacity), identity, **servicer_args)
    methods = {f"/openjev.worker.v1.WorkerService/{m}": interceptors.Observer() for m in ("Execute", "ExecuteUnary")}
    chain = [interceptors.RequestInterceptor(methods, make_ids=True)] if observed else []
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=chain)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield worker_pb2_grpc.WorkerServiceStub(channel), servicer
    finally:
        runner.go.set()
        server.stop(0)
        servicer.engine.close()


@pytest.mark.parametrize("unary", [True, False], ids=["unary", "stream"])
def test_a_full_queue_is_a_refusal_on_the_execute_span_not_an_error(unary):
    """An in-process servicer whose engine runs one request and lets none wait (queue capacity
    0): a second request while the first runs is RESOURCE_EXHAUSTED, and its `execute` span
    says so without ERROR (load, not a failure of the execution: alerts on span errors skip it).
    The running request's tokens stay held while it runs; the refused one's queue wait ends."""
    memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    exporter = memory.InMemorySpanExporter()
    runner = _GatedRunner()
    header = wire.ExecuteHeader(questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_NOUL, num_candidates=1)])
    candidates = [wire.Candidate(token_ids=[1, 2, 3])]
    assert tracing.configure("test", None, exporter=exporter)
    try:
        with in_process(runner, queue_capacity=0, max_held_tokens=64) as (stub, servicer):

            def call():
                """Start a call; returns what waits for its answer's first question."""
                if unary:
                    future = stub.ExecuteUnary.future(
                        wire.ExecuteUnaryRequest(header=header, candidates=candidates), timeout=30
                    )
                    return lambda: future.result(timeout=30).questions[0]
                replies = stub.Execute(stream(header, candidates), timeout=30)
                return lambda: next(replies).question

            first = call()
            assert runner.running.wait(30)
            assert servicer.held.held == 3  # a running request's ids count until it has run
            with pytest.raises(grpc.RpcError) as refused:
                call()()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            runner.go.set()
            assert list(first().probabilities) == [0.5, 0.5]
    finally:
        tracing.shutdown()
    spans = exporter.get_finished_spans()
    assert len([s for s in spans if s.name == "queue_wait"]) == 2  # the refused one's too: not left open
    executed = [s for s in spans if s.name == "execute"]
    outcomes = sorted(
        (s.attributes.get("openjev.status", ""), s.status.status_code.name, [e.name for e in s.events])
        for s in executed
    )
    assert outcomes == [("", "UNSET", []), ("RESOURCE_EXHAUSTED", "UNSET", [])], outcomes


def test_a_stream_ended_without_a_commit_is_counted_discarded(worker, stub):
    """Refused INVALID_ARGUMENT (its caller must not read an empty OK as an answer), and counted
    under the DISCARDED outcome of its kind, not as a malformed stream."""
    series = 'openjev_worker_execute_seconds_count{kind="choice",outcome="DISCARDED"}'

    def discarded() -> float:
        text = urllib.request.urlopen(worker.metrics, timeout=5).read().decode()
        return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(series)), 0.0)

    before = discarded()
    header, candidates = choice(2, 5)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Execute(iter(list(stream(header, candidates))[:-1]), timeout=30))  # all but the commit
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "malformed execute stream: ended without a commit"
    deadline = time.monotonic() + 10
    while discarded() != before + 1:  # counted as the call ends, after its status went out
        assert time.monotonic() < deadline, (before, discarded())
        time.sleep(0.02)


def test_a_failed_inference_is_internal():
    """A pass whose head score is not finite: never a made-up answer, INTERNAL (a fault of the
    server, not of the request or its caller)."""
    runner = _GatedRunner(score=float("nan"))
    runner.go.set()
    header = wire.ExecuteHeader(questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_NOUL, num_candidates=1)])
    request = wire.ExecuteUnaryRequest(header=header, candidates=[wire.Candidate(token_ids=[1, 2, 3])])
    with in_process(runner) as (stub, _), pytest.raises(grpc.RpcError) as failed:
        stub.ExecuteUnary(request, timeout=30)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert failed.value.details() == "inference failed: non-finite head score nan for segment 0"


def test_a_forced_policy_overrides_the_requested_one():
    """The transformers arm's worker runs every request with `off` (it cannot start from a
    parent's state), whatever policy the request names."""
    runner = _GatedRunner()
    runner.go.set()
    header = wire.ExecuteHeader(
        prefix_policy=api.PREFIX_POLICY_SHARED,
        questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_CHOICE, num_candidates=2)],
    )
    candidates = [wire.Candidate(question_index=0, candidate_index=i, token_ids=[1, 2, 3, 4 + i]) for i in range(2)]
    request = wire.ExecuteUnaryRequest(header=header, candidates=candidates)
    with in_process(runner, forced_policy="off") as (stub, _):
        summary = stub.ExecuteUnary(request, timeout=30).summary
    assert (summary.policy, summary.executed_policy) == (api.PREFIX_POLICY_OFF, api.PREFIX_POLICY_OFF)
    assert (summary.saved_tokens, summary.computed_tokens) == (0, 8)


def test_an_answer_computed_after_its_caller_left_is_logged_under_the_callers_outcome():
    """The caller's deadline passes during the request's one pass, which completes all the same:
    the `execute` line says OK (it was computed) with the outcome its metrics count it under,
    the caller's deadline, not a plain OK nobody got."""
    runner = _GatedRunner()
    header = wire.ExecuteHeader(questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_NOUL, num_candidates=1)])
    request = wire.ExecuteUnaryRequest(header=header, candidates=[wire.Candidate(token_ids=[1, 2, 3])])
    with capture_logs() as lines, in_process(runner, observed=True) as (stub, _):
        late = stub.ExecuteUnary.future(request, metadata=[("x-request-id", "late")], timeout=1.0)
        assert runner.running.wait(30)
        assert late.exception(timeout=30).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        runner.go.set()
        deadline = time.monotonic() + 10
        while not (ended := [line for line in lines if line["event"] == "execute"]):
            assert time.monotonic() < deadline, "no execute line"
            time.sleep(0.02)
    assert [(line["status"], line.get("outcome"), line["request_id"]) for line in ended] == [
        ("OK", "DEADLINE_EXCEEDED", "late")
    ]


def test_a_committed_request_keeps_no_room_while_it_waits_or_runs():
    """A stream that may send 128 tokens (2 candidates, max_length 64) sends 6 and commits; while
    it runs, a request of 3 more fits a budget of 130: the room kept for a request still arriving
    ends at its commit."""
    runner = _GatedRunner()
    header = wire.ExecuteHeader(questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_CHOICE, num_candidates=2)])
    candidates = [wire.Candidate(question_index=0, candidate_index=i, token_ids=[1, 2, 3 + i]) for i in range(2)]
    small = wire.ExecuteUnaryRequest(
        header=wire.ExecuteHeader(questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_NOUL, num_candidates=1)]),
        candidates=[wire.Candidate(token_ids=[1, 2, 3])],
    )
    with in_process(runner, max_held_tokens=130) as (stub, servicer):
        first = stub.Execute(stream(header, candidates), timeout=30)
        assert runner.running.wait(30)
        assert servicer.held.held == 6
        second = stub.ExecuteUnary.future(small, timeout=30)
        deadline = time.monotonic() + 10
        # its tokens taken while the first still runs (then it waits its turn), or it was refused
        while servicer.held.held != 9 and not second.done():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        runner.go.set()
        assert len(second.result().questions[0].probabilities) == 2
        assert next(first).question.question_index == 0
