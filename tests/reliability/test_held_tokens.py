"""The worker's budget of held candidate tokens (`--max-held-tokens`) on a real worker and frontend
on loopback: what uncommitted streams hold counts, a candidate past the budget ends its call
RESOURCE_EXHAUSTED (Execute, ExecuteUnary, and through the frontend), and everything is given
back when a call ends, however it ends.

Found by a review of the worker port on 2026-12-04: 144 streams that never commit (the work cap)
held ~33 MiB each of 4 M tokens until the commit timeout, nothing bounding their sum."""

from __future__ import annotations

import json
import queue
import re
import threading
import urllib.request

import grpc
import pytest
from held_gauge import wait_held

from openjev.client import Client
from openjev.tools import launch
from openjev.tools.soak import log_events
from openjev.v1 import decision_pb2 as api
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

MAX_REQUEST_TOKENS = 4000
MAX_HELD_TOKENS = 6000
BIG = {"state": "word " * 3200, "questions": {"q": {"type": "noul", "instructions": "ok?"}}}  # ~3,230 tokens
# 17 candidates of ~200 tokens: more than one message, so the frontend streams them
BIG_STREAMED = {
    "state": "word " * 150,
    "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(17)}}},
}
SMALL = {"state": "hi", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}


@pytest.fixture(scope="module")
def pair(demo_model, tmp_path_factory):
    metrics_port = launch.free_port()
    started = launch.start_pair(
        demo_model,
        tmp_path_factory.mktemp("held"),
        worker_args=[
            *("--max-request-tokens", str(MAX_REQUEST_TOKENS), "--max-held-tokens", str(MAX_HELD_TOKENS)),
            *("--metrics-port", str(metrics_port), "--state-cache-bytes", "0"),
        ],
        frontend_args=["--max-request-tokens", str(MAX_REQUEST_TOKENS)],
    )
    started.worker_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    yield started
    started.stop()


@pytest.fixture(scope="module")
def stub(pair):
    with grpc.insecure_channel(pair.worker.address) as channel:
        yield worker_pb2_grpc.WorkerServiceStub(channel)


def choice_header() -> wire.ExecuteHeader:
    """One choice question of two candidates."""
    return wire.ExecuteHeader(questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_CHOICE, num_candidates=2)])


def candidate(index: int, tokens: int) -> wire.Candidate:
    return wire.Candidate(question_index=0, candidate_index=index, token_ids=[1000 + i % 5000 for i in range(tokens)])


class OpenStream:
    """An Execute stream that sends its header and first candidate, then waits uncommitted until
    `commit()` or `cancel()`."""

    def __init__(self, stub, tokens: int):
        self._next: queue.Queue = queue.Queue()

        def messages():
            yield wire.ExecuteRequest(header=choice_header())
            yield wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=[candidate(0, tokens)]))
            yield from iter(self._next.get, None)

        self.call = stub.Execute(messages(), timeout=60)
        self.replies: list = []
        self.error: grpc.RpcError | None = None
        self._reader = threading.Thread(target=self._read)
        self._reader.start()

    def _read(self) -> None:
        try:
            self.replies.extend(self.call)
        except grpc.RpcError as error:
            self.error = error

    def commit(self, tokens: int) -> None:
        """Send the other candidate, of `tokens`, and the commit; wait for the answer."""
        self._next.put(wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=[candidate(1, tokens)])))
        self._next.put(wire.ExecuteRequest(commit=wire.Commit()))
        self._next.put(None)
        self._reader.join(30)

    def wait_ended(self, timeout: float = 10.0) -> None:
        self._reader.join(timeout)
        assert not self._reader.is_alive(), "the call is still open"
        self._next.put(None)

    def cancel(self) -> None:
        self.call.cancel()
        self._next.put(None)
        self._reader.join(30)


def unary(tokens: int) -> wire.ExecuteUnaryRequest:
    """One choice question: a candidate of `tokens` and one of 5."""
    return wire.ExecuteUnaryRequest(header=choice_header(), candidates=[candidate(0, tokens), candidate(1, 5)])


def test_uncommitted_streams_count_and_a_candidate_past_the_budget_is_refused(pair, stub):
    """Budget 6,000 tokens, a request at most 4,000 (two candidates: 4,000 may come): the others
    leave room for what the oldest request still arriving may send."""
    first = OpenStream(stub, 3000)
    try:
        wait_held(pair.worker_metrics, 3000)  # held while uncommitted; 1,000 more may come
        second = OpenStream(stub, 1000)
        wait_held(pair.worker_metrics, 4000)
        third = OpenStream(stub, 1001)  # 4,000 + 1,001 + the first's 1,000 > 6,000
        third.wait_ended()  # the worker ended it uncommitted
        assert third.error is not None and third.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert third.error.details() == (
            f"worker cannot hold 1001 more candidate tokens now (4000 of its {MAX_HELD_TOKENS} held, "
            "1000 kept for the oldest request still arriving); retry later"
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.ExecuteUnary(unary(1000), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "kept for the oldest request still arriving" in refused.value.details()
        wait_held(pair.worker_metrics, 4000)  # the refused calls gave back what they had taken
        # the oldest's own room: its 1,000 more take the total to 5,000; answered, it gives all back
        first.commit(1000)
        assert first.error is None and first.replies[-1].HasField("summary")
        wait_held(pair.worker_metrics, 1000)
        # the second is now the oldest arriving (3,000 may still come): 1,000 + 2,000 + 3,000 fits
        assert len(stub.ExecuteUnary(unary(1995), timeout=60).questions) == 1
        second.commit(5)
        assert second.error is None and second.replies[-1].HasField("summary")
    finally:
        first.cancel()
    wait_held(pair.worker_metrics, 0)
    logged = [r for r in log_events(pair.worker.log_text(), "execute") if r.get("status") == "RESOURCE_EXHAUSTED"]
    assert len(logged) >= 2 and all("kept for the oldest request" in r["reason"] for r in logged)
    # its header had been read and checked: logged and counted under its kinds, not `unknown`
    assert all(r["kinds"] and r["candidates"] >= 1 for r in logged), logged
    text = urllib.request.urlopen(pair.worker_metrics, timeout=5).read().decode()
    assert 'openjev_worker_execute_seconds_count{kind="unknown",outcome="RESOURCE_EXHAUSTED"}' not in text


def test_a_malformed_or_uncommitted_stream_gives_back_what_it_held(pair, stub):
    def bad():
        yield wire.ExecuteRequest(header=choice_header())
        yield wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=[candidate(0, 3000)]))
        yield wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=[candidate(0, 3)]))  # sent twice

    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Execute(bad(), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "candidate (0, 0) sent twice" in refused.value.details()  # not the missing commit
    wait_held(pair.worker_metrics, 0)

    def half_closed():  # ends without a commit
        yield wire.ExecuteRequest(header=choice_header())
        yield wire.ExecuteRequest(batch=wire.CandidateBatch(candidates=[candidate(0, 3000)]))

    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Execute(half_closed(), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "malformed execute stream: ended without a commit"
    wait_held(pair.worker_metrics, 0)


@pytest.mark.parametrize("big", [BIG, BIG_STREAMED], ids=["unary", "stream"])
def test_through_the_frontend_a_full_budget_is_resource_exhausted_and_frees(pair, stub, big):
    """One noul candidate goes in one ExecuteUnary call, 17 choice candidates as an Execute
    stream (refused part-way, while the frontend is still tokenizing)."""
    blocker = OpenStream(stub, 3000)
    with Client(pair.frontend.address) as client:
        try:
            wait_held(pair.worker_metrics, 3000)
            small = client.stub.Decide(api.DecideRequest(request_json=json.dumps(SMALL)), timeout=60)
            assert len(small.answers) == 1  # a request within what is left runs
            with pytest.raises(grpc.RpcError) as refused:
                client.stub.Decide(api.DecideRequest(request_json=json.dumps(big)), timeout=60)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert re.fullmatch(
                r"worker: worker cannot hold \d+ more candidate tokens now \(\d+ of its 6000 held, 1000 kept for "
                r"the oldest request still arriving\); retry later",
                refused.value.details(),
            )
        finally:
            blocker.cancel()
        wait_held(pair.worker_metrics, 0)
        answer = client.stub.Decide(api.DecideRequest(request_json=json.dumps(big)), timeout=60)
        assert len(answer.answers) == 1


def test_a_stream_refused_part_way_is_sent_again_to_the_fleet(demo_model, tmp_path):
    """Two workers behind a frontend with context affinity; one holds an uncommitted stream.
    A streamed request whose context's worker refuses it part-way (before its commit) is sent
    once more, round-robin, with the rest of its candidates: before the resend went past the
    commit (2026-12-05) it went back to the client RESOURCE_EXHAUSTED with the other worker idle."""
    limits = ["--max-request-tokens", str(MAX_REQUEST_TOKENS)]
    blocked_metrics_port = launch.free_port()
    metrics_args = {"a": ["--metrics-port", str(blocked_metrics_port)], "b": []}
    workers = [
        launch.start_worker(
            demo_model,
            tmp_path,
            [*limits, "--max-held-tokens", str(MAX_HELD_TOKENS), *metrics_args[name]],
            name=f"worker-{name}",
        )
        for name in "ab"
    ]
    frontend = None
    try:
        frontend = launch.start_frontend(demo_model, ",".join(w.address for w in workers), tmp_path, limits)
        launch.wait_serving(frontend.address)
        with grpc.insecure_channel(workers[0].address) as channel, Client(frontend.address) as client:
            blocker = OpenStream(worker_pb2_grpc.WorkerServiceStub(channel), 3000)
            try:
                # The blocker's candidate goes out on gRPC's sending thread: a request that reaches
                # the worker before it gets the blocker refused instead, and then nothing is blocked.
                wait_held(f"http://127.0.0.1:{blocked_metrics_port}/metrics", 3000)
                for i in range(14):  # 14 contexts: some hash to the blocked worker (all miss it 1 time in 16,384)
                    body = dict(BIG_STREAMED, state=f"context {i} " + BIG_STREAMED["state"])
                    try:
                        client.stub.Decide(api.DecideRequest(request_json=json.dumps(body)), timeout=60)
                    except grpc.RpcError as error:  # sent again to the blocked worker: refused there too
                        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                assert blocker.error is None, blocker.error  # it held its tokens throughout
            finally:
                blocker.cancel()
        decide_lines = log_events(frontend.log_text(), "decide")
        decided = [(line.get("route"), line["status"]) for line in decide_lines]
        sent = {line["request_id"] for line in decide_lines}
        refused_part_way = [  # the frontend's requests, not the blocker (which has no request id)
            line
            for line in log_events(workers[0].log_text(), "execute")
            if line.get("status") == "RESOURCE_EXHAUSTED" and line.get("request_id") in sent
        ]
    finally:
        if frontend is not None:
            frontend.stop()
        for worker in workers:
            worker.stop()
    assert refused_part_way, decided  # the blocked worker refused some
    assert ("affinity", "RESOURCE_EXHAUSTED") not in decided, decided  # none went back unsent
    assert any(route == "fallback" for route, _ in decided), decided
