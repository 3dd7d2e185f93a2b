"""The scheduler's arrival wait (worker/scheduler.py, `--arrival-wait-ms`): a pass with room left
waits, up to the bound, for calls known to be arriving, and only for them. On the real PyTorch
runner (demo export), then through a real worker on loopback."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from openjev.tools import launch
from openjev.tools.soak import log_events
from openjev.worker.engine import Cancelled, Engine, QuestionWork
from openjev.worker.planner import CPU_COST_MODEL, PackLimits
from openjev.worker.runner_api import SegmentRun
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

TEMPERATURE = 2.0
WAIT = 5.0  # far longer than any test may take: a wait that is not cut short fails the test
HOLD = 0.3  # how long an arriving call takes to be admitted


@pytest.fixture(scope="module")
def torch_runner(demo_model):
    from openjev.worker.model.runner import TorchRunner

    return TorchRunner(demo_model, num_threads=1)


class PassLog:
    """Wraps the real runner; records how many runs each pass carried."""

    backend = "torch"

    def __init__(self, inner):
        self.inner = inner
        self.max_pass_depth = inner.max_pass_depth
        self.passes: list[int] = []

    def run_launch(self, runs: list[SegmentRun]):
        self.passes.append(len(runs))
        return self.inner.run_launch(runs)


def noul(*tokens: int) -> list[QuestionWork]:
    return [QuestionWork("noul", (tuple(range(100, 130)) + tokens,))]


def engine(runner, limits: PackLimits | None = None) -> Engine:
    limits = limits or PackLimits()
    return Engine(runner, cost_model=CPU_COST_MODEL, pack_limits=limits, arrival_wait_seconds=WAIT)


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as error:  # handed to the test
            out.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, out


def test_a_pass_waits_for_a_call_arriving_and_both_ride_it(torch_runner):
    log = PassLog(torch_runner)
    e = engine(log)
    arrival = e.scheduler.arrival()
    arrival.begin()  # a call being read: its request is not admitted yet
    first, got_first = in_thread(lambda: e.execute(noul(1), temperature=TEMPERATURE))
    time.sleep(HOLD)
    started = time.perf_counter()
    second = e.execute(noul(2), temperature=TEMPERATURE, arrival=arrival)
    first.join(30)
    (one,) = got_first
    assert log.passes == [2], "the two requests did not share one pass"
    assert one.num_shared_passes == 1 and second.num_shared_passes == 1
    assert HOLD * 0.8 <= one.queue_seconds < WAIT / 2  # waited, and no longer than the arrival took
    assert time.perf_counter() - started < WAIT / 2


def test_a_lone_request_never_waits(torch_runner):
    e = engine(torch_runner)
    arrival = e.scheduler.arrival()
    arrival.begin()  # its own arrival: ended when it is admitted
    result = e.execute(noul(3), temperature=TEMPERATURE, arrival=arrival)
    assert result.queue_seconds < 0.5
    assert e.scheduler._arriving == 0


def test_the_wait_ends_when_an_arriving_call_fails(torch_runner):
    e = engine(torch_runner)
    arrival = e.scheduler.arrival()
    arrival.begin()
    first, got = in_thread(lambda: e.execute(noul(4), temperature=TEMPERATURE))
    time.sleep(HOLD)
    arrival.end()  # e.g. its stream was malformed: never admitted
    first.join(30)
    assert HOLD * 0.8 <= got[0].queue_seconds < WAIT / 2


def test_a_full_pass_does_not_wait(torch_runner):
    e = engine(torch_runner, limits=PackLimits(max_sequences=1))
    arrival = e.scheduler.arrival()
    arrival.begin()  # arriving, but no room in the pass for it
    try:
        result = e.execute(noul(5), temperature=TEMPERATURE)
    finally:
        arrival.end()
    assert result.queue_seconds < 0.5


def test_a_request_that_leaves_during_the_wait_leaves_at_once(torch_runner):
    e = engine(torch_runner)
    arrival = e.scheduler.arrival()
    arrival.begin()
    stop = threading.Event()
    first, got = in_thread(lambda: e.execute(noul(6), temperature=TEMPERATURE, should_stop=stop.is_set))
    time.sleep(HOLD)
    left = time.perf_counter()
    stop.set()  # its client went away (or its deadline passed) while the pass waited
    first.join(30)
    assert isinstance(got[0], Cancelled)
    assert time.perf_counter() - left < 1.0
    arrival.end()
    assert e.execute(noul(7), temperature=TEMPERATURE).queue_seconds < 0.5  # the loop still serves


# ---- through a real worker ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker(demo_model, tmp_path_factory):
    args = ["--arrival-wait-ms", str(WAIT * 1e3), "--state-cache-bytes", "0"]
    process = launch.start_worker(demo_model, tmp_path_factory.mktemp("arrival"), args)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stub(worker):
    with grpc.insecure_channel(worker.address) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel)


def unary(token: int) -> wire.ExecuteUnaryRequest:
    header = wire.ExecuteHeader(questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_NOUL, num_candidates=1)])
    candidate = wire.Candidate(question_index=0, candidate_index=0, token_ids=[*range(100, 130), token])
    return wire.ExecuteUnaryRequest(header=header, candidates=[candidate])


def held_stream(request: wire.ExecuteUnaryRequest, release: threading.Event, header_first: bool):
    """An Execute stream of `request` that stops before its first message (header_first=False)
    or after its header, until `release`."""
    if header_first:
        yield wire.ExecuteRequest(header=request.header)
    release.wait(30)
    if not header_first:
        return  # ended without a message: discarded
    yield wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=request.candidates))
    yield wire.ExecuteRequest(commit=wire.Commit())


def test_a_stream_being_read_and_a_unary_call_share_a_pass(worker, stub):
    before = len(worker.log_text())
    release = threading.Event()
    stream, streamed = in_thread(lambda: list(stub.Execute(held_stream(unary(11), release, True), timeout=30)))
    time.sleep(HOLD)  # its header is in: the worker counts it as arriving
    threading.Timer(HOLD, release.set).start()
    reply = stub.ExecuteUnary(unary(12), timeout=30)
    stream.join(30)
    assert streamed[0][-1].HasField("summary")
    assert HOLD * 0.8 <= reply.summary.queue_seconds < WAIT / 2
    done = [e for e in log_events(worker.log_text()[before:], "execute") if e.get("status") == "OK"]
    assert [e["shared_passes"] for e in done] == [1, 1]


def test_a_lone_call_and_an_idle_stream_do_not_wait(worker, stub):
    assert stub.ExecuteUnary(unary(13), timeout=30).summary.queue_seconds < 0.5
    release = threading.Event()
    stream, _ = in_thread(lambda: list(stub.Execute(held_stream(unary(14), release, False), timeout=30)))
    time.sleep(HOLD)  # open, nothing sent: not arriving
    try:
        assert stub.ExecuteUnary(unary(15), timeout=30).summary.queue_seconds < 0.5
    finally:
        release.set()
        stream.join(30)
