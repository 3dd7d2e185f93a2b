"""An idle worker's next pass waits briefly for requests already on their way in (scheduler
`Arrival`), on the real PyTorch runner: sent together, they share their first pass; a request
with nothing else arriving never waits; the wait is bounded; every way a stream can end releases
its arrival, so no later request waits for one that will never come."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from openjev.worker.engine import Engine, QuestionWork
from openjev.worker.planner import CPU_COST_MODEL
from openjev.worker.runner_api import SegmentRun
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

TEMPERATURE = 2.0
LONG = 5.0  # a coalescing window no test should ever sit out
A = [QuestionWork("noul", ((11, 12, 13, 14),))]
B = [QuestionWork("choice", ((21, 22, 23), (21, 22, 24)))]


@pytest.fixture(scope="module")
def torch_runner(demo_model):
    from openjev.worker.model.runner import TorchRunner

    return TorchRunner(demo_model, num_threads=2)


class Passes:
    """Wraps the real runner; counts the requests' segments of every pass it is given."""

    backend = "torch"

    def __init__(self, inner):
        self.inner, self.max_pass_depth = inner, inner.max_pass_depth
        self.sizes: list[int] = []

    def run_launch(self, runs: list[SegmentRun]):
        self.sizes.append(len(runs))
        return self.inner.run_launch(runs)


def engine_of(runner, coalesce_seconds: float) -> Engine:
    return Engine(runner, cost_model=CPU_COST_MODEL, coalesce_seconds=coalesce_seconds)


def in_thread(engine: Engine, work, out: dict, key: str, **kwargs) -> threading.Thread:
    def run() -> None:
        out[key] = engine.execute(work, temperature=TEMPERATURE, policy="off", **kwargs)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_requests_arriving_together_share_their_first_pass(torch_runner):
    solo = engine_of(torch_runner, 0)
    alone = {k: solo.execute(w, temperature=TEMPERATURE, policy="off") for k, w in (("A", A), ("B", B))}
    passes = Passes(torch_runner)
    engine = engine_of(passes, LONG)
    arrival = engine.scheduler.arrival()
    arrival.begin()  # B's stream is being read
    out: dict = {}
    first = in_thread(engine, A, out, "A")
    wait_until(lambda: engine.scheduler.depth == 1)  # A admitted
    time.sleep(0.2)
    assert passes.sizes == [], "an idle worker started A alone while B was arriving"
    second = in_thread(engine, B, out, "B", arrival=arrival)
    first.join(60)
    second.join(60)
    assert passes.sizes == [3], "A's one segment and B's two in one pass"
    for key in "AB":
        assert out[key].num_shared_passes == 1
        assert out[key].probabilities == alone[key].probabilities


def test_a_request_with_nothing_arriving_does_not_wait(torch_runner):
    engine = engine_of(torch_runner, LONG)
    engine.execute(A, temperature=TEMPERATURE, policy="off")  # first use: warm-up out of the timing
    started = time.perf_counter()
    engine.execute(A, temperature=TEMPERATURE, policy="off")
    assert time.perf_counter() - started < LONG / 2


def test_the_wait_is_bounded_and_ends_when_an_arrival_fails(torch_runner):
    engine = engine_of(torch_runner, 0.3)
    never = engine.scheduler.arrival()
    never.begin()  # a stream that never commits
    started = time.perf_counter()
    engine.execute(A, temperature=TEMPERATURE, policy="off")
    assert time.perf_counter() - started >= 0.3
    never.end()

    engine = engine_of(torch_runner, LONG)
    failing = engine.scheduler.arrival()
    failing.begin()
    out: dict = {}
    thread = in_thread(engine, A, out, "A")
    wait_until(lambda: engine.scheduler.depth == 1)
    started = time.perf_counter()
    failing.end()  # its stream broke: the lingering pass goes at once
    thread.join(60)
    assert "A" in out and time.perf_counter() - started < LONG / 2


@pytest.fixture(scope="module")
def servicer_stub(torch_runner, demo_model):
    from openjev.export import load_export_meta
    from openjev.worker.service import WorkerIdentity, WorkerServicer

    meta = load_export_meta(demo_model)
    identity = WorkerIdentity(
        model_id=meta.model_id,
        alias=meta.alias,
        checkpoint_revision="test",
        temperature=meta.temperature,
        max_length=meta.max_length,
        vocab_size=torch_runner.config.vocab_size,
        tokenizer_fingerprint="test",
        backend="torch",
        default_policy="off",
        max_questions=8,
        max_candidates=64,
        max_batch_candidates=16,
        max_launch_sequences=64,
        max_launch_tokens=4096,
        queue_capacity=8,
    )
    engine = engine_of(torch_runner, LONG)
    server = grpc.server(futures.ThreadPoolExecutor(8))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(engine, identity), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield engine, worker_pb2_grpc.WorkerServiceStub(channel)
    server.stop(None)


def test_every_stream_ending_releases_its_arrival(servicer_stub):
    engine, stub = servicer_stub
    header = wire.ExecuteHeader(questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_NOUL, num_candidates=1)])
    batch = wire.CandidateBatch(candidates=[wire.Candidate(question_index=0, candidate_index=0, token_ids=[5, 6, 7])])
    streams = {
        "malformed": [wire.ExecuteRequest(batch=batch)],
        "no commit": [wire.ExecuteRequest(header=header), wire.ExecuteRequest(batch=batch)],
        "answered": [
            wire.ExecuteRequest(header=header),
            wire.ExecuteRequest(batch=batch),
            wire.ExecuteRequest(commit=wire.Commit()),
        ],
    }
    for name, messages in streams.items():
        started = time.perf_counter()
        try:
            list(stub.Execute(iter(messages), timeout=30))
        except grpc.RpcError as error:
            assert name == "malformed" and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert time.perf_counter() - started < LONG / 2, name
        wait_until(lambda: engine.scheduler._arriving == 0, timeout=5)
