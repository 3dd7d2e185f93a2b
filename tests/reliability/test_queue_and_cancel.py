"""Queue, deadlines and cancellation through the real gRPC API. The worker runs one sequence
per launch (a launch boundary about every 0.5 s on the CPU demo model) and lets two requests
wait; a long request (16 candidates of ~2,000 tokens, policy off) keeps it busy for seconds.
What the worker did is read from its JSON log (one `execute` line per request)."""

from __future__ import annotations

import gc
import time
import urllib.request
import uuid
import weakref

import grpc
import pytest

from openjev.client import Client
from openjev.tools import launch
from openjev.tools.soak import log_events, rss_bytes
from openjev.v1 import decision_pb2 as api

LONG = {
    "state": "word " * 2000,
    "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(16)}}},
}
# 17 candidates: one more than a batch, so the frontend streams it (Execute) instead of sending
# it in one ExecuteUnary call; the deadline and cancellation tests run both ways.
LONG_STREAMED = {
    "state": LONG["state"],
    "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(17)}}},
}
WAYS = [pytest.param(LONG, "ExecuteUnary", id="unary"), pytest.param(LONG_STREAMED, "Execute", id="stream")]
SMALL = {"state": "hi", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}
LONG_SECONDS = 6.0  # well under the ~8 s the long request takes


def rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def send(stub, body, request_id, timeout=60.0):
    import json

    return stub.Decide.future(
        api.DecideRequest(request_json=json.dumps(body), prefix_policy=api.PREFIX_POLICY_OFF),
        timeout=timeout,
        metadata=[("x-request-id", request_id)],
    )


def worker_line(worker, request_id, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [r for r in log_events(worker.log_text(), "execute") if r.get("request_id") == request_id]
        if lines:
            assert len(lines) == 1, lines
            return lines[0] | {"seen_at": time.monotonic()}
        time.sleep(0.05)
    raise AssertionError(f"worker logged nothing for {request_id}")


def wait_started(worker, request_id, timeout=30.0) -> None:
    """Until the request's first pass began (worker at debug level)."""
    deadline = time.monotonic() + timeout
    while request_id not in [r.get("request_id") for r in log_events(worker.log_text(), "execute_started")]:
        assert time.monotonic() < deadline, f"{request_id} never started"
        time.sleep(0.02)


def wait_admitted(pair, count, timeout=30.0) -> None:
    """Until the worker holds `count` requests (running or waiting): the queue depth gauge."""
    deadline = time.monotonic() + timeout
    while True:
        text = urllib.request.urlopen(pair.worker_metrics, timeout=5).read().decode()
        depth = next(float(x.split()[1]) for x in text.splitlines() if x.startswith("openjev_worker_queue_depth "))
        if depth >= count:
            return
        assert time.monotonic() < deadline, f"{depth} requests admitted, not {count}"
        time.sleep(0.02)


def frontend_method(pair, request_id) -> str:
    """The worker call the frontend made for the request (its `decide` log line says)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [r for r in log_events(pair.frontend.log_text(), "decide") if r.get("request_id") == request_id]
        if lines:
            return lines[0]["worker_method"]
        time.sleep(0.05)
    raise AssertionError(f"frontend logged nothing for {request_id}")


@pytest.fixture
def stub(busy_pair):
    with Client(busy_pair.frontend.address) as c:
        yield c.stub


@pytest.mark.parametrize(("long", "method"), WAYS)
def test_deadline_propagates_and_work_stops_at_next_launch(busy_pair, stub, long, method):
    long_id = rid("deadline")
    started = time.monotonic()
    future = send(stub, long, long_id, timeout=1.5)
    with pytest.raises(grpc.RpcError) as caught:
        future.result()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3
    line = worker_line(busy_pair.worker, long_id)
    # stopped mid-request; the caller's deadline, as the worker's metrics count it
    assert line["status"] == line["outcome"] == "DEADLINE_EXCEEDED" and "before it finished" in line["reason"]
    assert line["seen_at"] - started < LONG_SECONDS  # at a launch boundary, well before the end
    assert frontend_method(busy_pair, long_id) == method
    small_started = time.monotonic()
    send(stub, SMALL, rid("after")).result()
    assert time.monotonic() - small_started < 2  # the worker is free again


@pytest.mark.parametrize(("long", "method"), WAYS)
def test_client_cancel_propagates_to_the_worker(busy_pair, stub, long, method):
    long_id = rid("cancel")
    future = send(stub, long, long_id)
    time.sleep(1.0)
    cancelled_at = time.monotonic()
    assert future.cancel()
    line = worker_line(busy_pair.worker, long_id)
    assert line["status"] == "CANCELLED" and line["outcome"] == "CLIENT_CANCELLED"
    assert line["seen_at"] - cancelled_at < 2.5
    assert frontend_method(busy_pair, long_id) == method
    started = time.monotonic()
    send(stub, SMALL, rid("after")).result()
    assert time.monotonic() - started < 2


def test_full_queue_answers_resource_exhausted_at_once(busy_pair, stub):
    running_id = rid("run")
    running, waiting = [send(stub, LONG, running_id)], []
    wait_started(busy_pair.worker, running_id)
    waiting_ids = [rid("wait") for _ in range(2)]
    for n, request_id in enumerate(waiting_ids):
        waiting.append(send(stub, SMALL, request_id))
        wait_admitted(busy_pair, 2 + n)
    refused_id = rid("full")
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        send(stub, SMALL, refused_id).result()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full (2 waiting)" in caught.value.details()
    assert time.monotonic() - started < 1.0
    assert worker_line(busy_pair.worker, refused_id)["status"] == "RESOURCE_EXHAUSTED"
    running[0].cancel()  # the waiting ones then run, in arrival order (FIFO)
    for future in waiting:
        future.result(timeout=30)
    first, second = (worker_line(busy_pair.worker, i) for i in waiting_ids)
    assert first["status"] == second["status"] == "OK"
    # FIFO: the first to arrive ran first (the scheduler's thread logs each first pass, in order;
    # the `execute` lines come from each request's own thread, in either order)
    started = [e["request_id"] for e in log_events(busy_pair.worker.log_text(), "execute_started")]
    assert [i for i in started if i in waiting_ids] == waiting_ids


def test_timed_out_request_leaves_the_queue(busy_pair, stub):
    running_id, queued_id = rid("run"), rid("queued")
    running = send(stub, LONG, running_id)
    wait_started(busy_pair.worker, running_id)
    queued = send(stub, LONG, queued_id, timeout=1.0)
    with pytest.raises(grpc.RpcError) as caught:
        queued.result()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    line = worker_line(busy_pair.worker, queued_id)
    assert line["status"] == "DEADLINE_EXCEEDED" and line["reason"] == "cancelled while queued"
    # Both waiting places are free again: two more wait, a third is refused.
    later = [send(stub, SMALL, rid("later")) for _ in range(2)]
    wait_admitted(busy_pair, 3)
    with pytest.raises(grpc.RpcError) as caught:
        send(stub, SMALL, rid("full")).result()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    running.cancel()
    for future in later:
        future.result(timeout=30)
    assert worker_line(busy_pair.worker, running_id)["status"] == "CANCELLED"


class _ClientGone:
    """The servicer context of a Decide whose client left while the frontend validated and
    tokenized it: gRPC has run its callbacks and takes no more (add_callback returns False)."""

    def add_callback(self, callback) -> bool:
        return False

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None  # a cancel, not a deadline


def _long_worker_request(request_id: str):
    """LONG as the frontend sends it to a worker: its header and 16 candidates of 2,000 tokens."""
    from openjev.worker.v1 import worker_pb2 as wire

    header = wire.ExecuteHeader(
        request_id=request_id,
        prefix_policy=api.PREFIX_POLICY_OFF,
        questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_CHOICE, num_candidates=16)],
    )
    candidates = [wire.Candidate(question_index=0, candidate_index=c, token_ids=[1000 + c] * 2000) for c in range(16)]
    return header, candidates


class _ClientTimedOut(_ClientGone):
    """The same, gone because its deadline passed."""

    def time_remaining(self) -> float | None:
        return 0.0


def test_a_client_whose_deadline_passed_is_not_cancelled_for(busy_pair):
    """The worker call carries the client's deadline and ends DEADLINE_EXCEEDED there by itself;
    the frontend's cancel reached a busy worker, which had received the call late, before its copy
    of the deadline, and was counted and logged a client's cancel (2 of 30 in a review's run)."""
    from openjev.frontend import worker_calls
    from openjev.frontend.worker_calls import Refused
    from openjev.worker.v1 import worker_pb2 as wire
    from openjev.worker.v1 import worker_pb2_grpc

    request_id = rid("late")
    header, candidates = _long_worker_request(request_id)
    request = wire.ExecuteUnaryRequest(header=header, candidates=candidates)
    with grpc.insecure_channel(busy_pair.worker.address) as channel, pytest.raises(Refused) as caught:
        worker = worker_pb2_grpc.WorkerServiceStub(channel)
        worker_calls.call_unary(worker, request, [("x-request-id", request_id)], 1.0, _ClientTimedOut(), 1)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    line = worker_line(busy_pair.worker, request_id)
    assert line["status"] == "DEADLINE_EXCEEDED" and line["outcome"] == "DEADLINE_EXCEEDED", line


@pytest.mark.parametrize("method", ["ExecuteUnary", "Execute"])
def test_a_client_gone_before_the_worker_call_is_not_run_for_nobody(busy_pair, method):
    from openjev.frontend import worker_calls
    from openjev.frontend.worker_calls import Refused
    from openjev.worker.v1 import worker_pb2 as wire
    from openjev.worker.v1 import worker_pb2_grpc

    request_id = rid("gone")
    header, candidates = _long_worker_request(request_id)
    metadata = [("x-request-id", request_id)]
    with grpc.insecure_channel(busy_pair.worker.address) as channel:
        worker = worker_pb2_grpc.WorkerServiceStub(channel)
        with pytest.raises(Refused) as caught:
            if method == "ExecuteUnary":
                request = wire.ExecuteUnaryRequest(header=header, candidates=candidates)
                worker_calls.call_unary(worker, request, metadata, 60.0, _ClientGone(), 1)
            else:
                stream = [
                    wire.ExecuteRequest(header=header),
                    wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=candidates)),
                    wire.ExecuteRequest(commit=wire.Commit()),
                ]
                worker_calls.call_stream(worker, iter(stream), metadata, 60.0, _ClientGone(), 1)
    assert caught.value.code == grpc.StatusCode.CANCELLED
    # the worker is free at once (it would be busy for seconds had it run the request)
    with Client(busy_pair.frontend.address) as client:
        started = time.monotonic()
        send(client.stub, SMALL, rid("after")).result()
        assert time.monotonic() - started < 2
    executed = [r for r in log_events(busy_pair.worker.log_text(), "execute") if r.get("request_id") == request_id]
    assert all(r["status"] != "OK" for r in executed), executed


def test_cancelled_requests_do_not_grow_worker_memory(busy_pair, stub):
    def cancel_one() -> None:
        request_id = rid("mem")
        future = send(stub, LONG, request_id)
        time.sleep(1.2)
        future.cancel()
        worker_line(busy_pair.worker, request_id)

    for _ in range(2):  # allocator growth from first use
        cancel_one()
    before = rss_bytes(busy_pair.worker.popen.pid)
    for _ in range(4):
        cancel_one()
    after = rss_bytes(busy_pair.worker.popen.pid)
    assert after - before < 64 * 2**20, (before, after)


def test_cancelled_or_failed_request_frees_its_states(demo_model):
    """In process, with the real runner: once execute() has raised (cancelled at a launch
    boundary, or a runner failure), no state a runner returned is still alive."""
    from openjev.worker.engine import Cancelled, Engine, InferenceError, QuestionWork
    from openjev.worker.model.runner import TorchRunner
    from openjev.worker.planner.plan import PackLimits

    runner = TorchRunner(demo_model)
    refs: list[weakref.ref] = []
    launches = [0]

    class Recording:
        backend = "torch"
        config = runner.config
        fail_at: int | None = None

        def run_launch(self, runs):
            launches[0] += 1
            if launches[0] == self.fail_at:
                raise RuntimeError("device lost")
            results = runner.run_launch(runs)
            refs.extend(weakref.ref(r.state) for r in results if r.state is not None)
            return results

    recording = Recording()
    engine = Engine(recording, pack_limits=PackLimits(max_sequences=1, max_tokens=4096))
    prefix = list(range(100, 400))
    work = [QuestionWork("choice", tuple(tuple(prefix + [500 + i, 600 + i]) for i in range(6)))]
    for expected, stop, fail_at in ((Cancelled, lambda: launches[0] >= 3, None), (InferenceError, lambda: False, 3)):
        launches[0], recording.fail_at = 0, fail_at
        refs.clear()
        with pytest.raises(expected):
            engine.execute(work, temperature=1.0, policy="shared", should_stop=stop)
        gc.collect()
        assert refs and not [r for r in refs if r() is not None]
    engine.close()


def test_a_stream_cut_by_the_frontends_worker_deadline_is_not_tokenized_on(demo_model, tmp_path):
    """The frontend's own cap on the worker call ends a stream while its 1,000 candidates are
    still being tokenized: the answer is DEADLINE_EXCEEDED at once, not the contract error of an
    over-long candidate at the end, which tokenizing the rest after the deadline would find (a
    review's mutant of the check showed no test pinned it)."""
    worker = launch.start_worker(demo_model, tmp_path)
    frontend = launch.start_frontend(demo_model, worker.address, tmp_path, ["--worker-deadline-seconds", "0.05"])
    questions = {
        f"q{q}": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(250)}}
        for q in range(4)
    }
    questions["q4"] = {"type": "noul", "instructions": "word " * 40_000}  # over max_length, last
    try:
        launch.wait_serving(frontend.address)
        with Client(frontend.address) as client, pytest.raises(grpc.RpcError) as caught:
            client.decide({"state": "s", "questions": questions}, timeout=60, request_id=rid("capped"))
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value.details()
    finally:
        frontend.stop()
        worker.stop()
