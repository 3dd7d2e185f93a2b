"""No kind of call starves another (real worker + frontend on loopback).

Idle streams used to take a server down: 32 open reflection or health Watch streams blocked every
Decide, 32 Execute streams that never commit blocked the worker, and a full queue was never
answered RESOURCE_EXHAUSTED because the RPC threads capped it first."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from openjev.client import Client
from openjev.frontend.worker_link import traffic_channel_options
from openjev.tools import launch
from openjev.tools.soak import log_events, outcome_counts
from openjev.v1 import decision_pb2 as api
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

SMALL = {"state": "hi", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}
IDLE = 64


def _blocked(first, release: threading.Event):
    """A request stream that sends `first` and then nothing until released."""
    yield first
    release.wait()


def _decide(address: str, timeout: float = 20.0) -> api.DecideResponse:
    with Client(address) as client:
        return client.stub.Decide(api.DecideRequest(request_json=json.dumps(SMALL)), timeout=timeout)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_idle_streams_of_every_kind_do_not_block_decide_or_health(pair):
    release = threading.Event()
    channels = [grpc.insecure_channel(pair.frontend.address) for _ in range(2)] + [
        grpc.insecure_channel(pair.worker.address)
    ]
    calls = []
    try:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channels[0])
        health = health_pb2_grpc.HealthStub(channels[1])
        worker = worker_pb2_grpc.WorkerServiceStub(channels[2])
        header = wire.ExecuteRequest(
            header=wire.ExecuteHeader(questions=[wire.QuestionShape(kind=3, num_candidates=1)])
        )
        for _ in range(IDLE):
            calls.append(
                reflection.ServerReflectionInfo(
                    _blocked(reflection_pb2.ServerReflectionRequest(list_services=""), release), timeout=120
                )
            )
            calls.append(health.Watch(health_pb2.HealthCheckRequest(), timeout=120))
            calls.append(worker.Execute(_blocked(header, release), timeout=120))
        time.sleep(2.0)  # every stream is open (or already refused) on the servers
        started = time.monotonic()
        reply = _decide(pair.frontend.address)
        assert len(reply.answers) == 1 and reply.answers[0].WhichOneof("kind") == "noul"
        assert _health(pair.frontend.address) == health_pb2.HealthCheckResponse.SERVING
        assert _health(pair.worker.address) == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - started < 10
        refused = [c for c in calls if c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert refused, "streams over a class's cap are refused, not queued"
        assert all("concurrent" in c.details() for c in refused)
    finally:
        release.set()
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()


def _silent() -> Iterator[bytes]:
    """A request stream that sends nothing (headers only) until its call ends."""
    threading.Event().wait(120)
    yield b""


def test_calls_that_never_send_their_message_do_not_shut_the_port(pair):
    """Unary calls whose client sends headers and no message: grpcio holds a slot and a thread for
    each while it waits, before any cap or token check runs, so 200 of them (no token needed) left
    health and Decide RESOURCE_EXHAUSTED for as long as the client liked."""
    methods = ["/openjev.v1.DecisionService/Decide", "/grpc.health.v1.Health/Check"]
    channel = grpc.insecure_channel(pair.frontend.address)
    calls = []
    try:
        for i in range(200):
            silent = channel.stream_unary(methods[i % 2], request_serializer=bytes, response_deserializer=bytes)
            calls.append(silent.future(_silent(), timeout=120))
        time.sleep(2.0)  # every call is open (or already cancelled) on the server
        assert _health(pair.frontend.address) == health_pb2.HealthCheckResponse.SERVING
        reply = _decide(pair.frontend.address)
        assert len(reply.answers) == 1
        assert sum(c.done() for c in calls) > 150  # cancelled as newer ones came: a few wait at most
    finally:
        for call in calls:
            call.cancel()
        channel.close()


def test_uncommitted_execute_is_cancelled_after_the_commit_timeout(demo_model, tmp_path):
    metrics_port = launch.free_port()
    worker = launch.start_worker(
        demo_model, tmp_path, ["--commit-timeout-seconds", "1", "--metrics-port", str(metrics_port)]
    )
    release = threading.Event()
    try:
        with grpc.insecure_channel(worker.address) as channel:
            header = wire.ExecuteRequest(
                header=wire.ExecuteHeader(questions=[wire.QuestionShape(kind=3, num_candidates=1)])
            )
            started = time.monotonic()
            call = worker_pb2_grpc.WorkerServiceStub(channel).Execute(_blocked(header, release), timeout=60)
            with pytest.raises(grpc.RpcError) as caught:
                list(call)
            assert caught.value.code() == grpc.StatusCode.CANCELLED
            assert time.monotonic() - started < 5
        # counted as the worker's own timeout, not as a caller that went away
        deadline = time.monotonic() + 10
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        while (
            outcomes := outcome_counts(url, "openjev_worker_execute_seconds_count")
        ) == {} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert outcomes == {"COMMIT_TIMEOUT": 1.0}
        # under its header's kind, and the log line names the outcome the metric counts
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        assert 'openjev_worker_execute_seconds_count{kind="noul",outcome="COMMIT_TIMEOUT"} 1.0' in text
        (line,) = [r for r in log_events(worker.log_text(), "execute") if r.get("reason") == "no commit in time"]
        assert line["outcome"] == "COMMIT_TIMEOUT" and line["kinds"] == ["noul"], line
        # a caller whose deadline passes before its commit went away; the log says so
        with grpc.insecure_channel(worker.address) as channel, pytest.raises(grpc.RpcError) as caught:
            list(worker_pb2_grpc.WorkerServiceStub(channel).Execute(_blocked(header, release), timeout=0.3))
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # and so is one that cancels (a cancel may end the stream before gRPC marks the call inactive)
        with grpc.insecure_channel(worker.address) as channel:
            for _ in range(4):
                call = worker_pb2_grpc.WorkerServiceStub(channel).Execute(_blocked(header, release), timeout=30)
                time.sleep(0.2)
                call.cancel()
        deadline = time.monotonic() + 10
        while len(log_events(worker.log_text(), "execute")) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        reasons = [e["reason"] for e in log_events(worker.log_text(), "execute")][1:]
        assert reasons == ["client went away before commit"] * 5, reasons
    finally:
        release.set()
        worker.stop()


# ~2.8 s of the demo worker alone at one sequence a launch: 1,500 words (~1.2 s) left the 60 small
# requests sent 1 s after it ~0.2 s to arrive while it ran, and on an idle machine 19 were refused
LONG = {
    "state": "word " * 3000,
    "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(8)}}},
}


def test_full_queue_is_resource_exhausted_with_default_threads(demo_model, tmp_path):
    """A queue longer than the old 32 RPC threads: 60 requests behind a busy worker. Before, all
    60 waited (threads capped the queue at 31); now those past the queue are refused at once."""
    started_pair = launch.start_pair(
        demo_model, tmp_path, worker_args=["--queue-capacity", "40", "--max-launch-sequences", "1"]
    )
    try:
        with Client(started_pair.frontend.address) as client:
            body = api.DecideRequest(request_json=json.dumps(LONG), prefix_policy=api.PREFIX_POLICY_OFF)
            long_call = client.stub.Decide.future(body, timeout=120)
            time.sleep(1.0)
            small = api.DecideRequest(request_json=json.dumps(SMALL))
            sent = time.monotonic()
            with futures.ThreadPoolExecutor(60) as pool:

                def one(_):
                    try:
                        client.stub.Decide(small, timeout=120)
                        return "OK", time.monotonic() - sent
                    except grpc.RpcError as error:
                        return error.code().name, time.monotonic() - sent

                outcomes = list(pool.map(one, range(60)))
            long_call.result()
        exhausted = [seconds for code, seconds in outcomes if code == "RESOURCE_EXHAUSTED"]
        assert {code for code, _ in outcomes} <= {"OK", "RESOURCE_EXHAUSTED"}
        assert len(exhausted) >= 60 - 40, outcomes
        assert max(exhausted) < 3.0, "refused at once, not after waiting"
    finally:
        started_pair.stop()


def test_the_worker_admits_the_health_watches_of_many_frontends(demo_model, tmp_path):
    """Every frontend's traffic channels hold a health Watch on each worker (gRPC's client-side
    health checking), two a frontend with affinity. At the public port's cap of 32 a 17th
    frontend's Watch was refused, its channel stayed unhealthy and the frontend NOT_SERVING for
    good, while the worker served (a review helper's finding). 40 traffic channels (20 frontends'
    worth) all connect, and a frontend started after them serves."""
    worker = launch.start_worker(demo_model, tmp_path, [])
    channels: list[grpc.Channel] = []
    frontend = None
    try:
        for i in range(40):  # the frontend's own channel options; a distinct id: no shared subchannel
            channels.append(grpc.insecure_channel(worker.address, [*traffic_channel_options(), ("openjev.test", i)]))
            grpc.channel_ready_future(channels[-1]).result(timeout=20)
        frontend = launch.start_frontend(demo_model, worker.address, tmp_path)
        reply = _decide(frontend.address)
        assert len(reply.answers) == 1 and reply.answers[0].WhichOneof("kind") == "noul"
    finally:
        for channel in channels:
            channel.close()
        if frontend is not None:
            frontend.stop()
        worker.stop()


@contextlib.contextmanager
def _health_behind(first, threads: int) -> Iterator[grpc.Channel]:
    """A channel to a health servicer on a server whose only interceptor is `first`."""
    server = grpc.server(futures.ThreadPoolExecutor(threads), interceptors=[first])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        server.stop(0).wait()


def test_a_lone_silent_call_is_cancelled_after_the_first_message_bound():
    """Below the count that cancels the oldest, a call that never sends its message still ends:
    a sweeper cancels it after `seconds` (a port whose slots are all held sees no new call), and
    says so in the log (no servicer ran to log the call)."""
    from openjev.limits import FirstMessage

    first = FirstMessage(most=4, seconds=0.5)
    with structlog.testing.capture_logs() as lines, _health_behind(first, threads=4) as channel:
        silent = channel.stream_unary("/grpc.health.v1.Health/Check", bytes, bytes).future(_silent(), timeout=30)
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        with pytest.raises(grpc.RpcError) as ended:
            silent.result(timeout=10)
        assert ended.value.code() == grpc.StatusCode.CANCELLED and first.waiting() == 0
    missing = [line for line in lines if line["event"] == "first_message_missing"]
    assert len(missing) == 1, lines
    assert missing[0]["method"] == "/grpc.health.v1.Health/Check" and missing[0]["status"] == "CANCELLED"
    assert missing[0]["reason"] == "no request message within 0.5 s" and missing[0]["waited_s"] >= 0.5
    assert missing[0]["peer"].startswith("ipv4:127.0.0.1:")


def test_calls_cancelled_for_the_count_are_counted_and_a_deadline_first_is_logged():
    """Calls beyond `most` waiting cancel the oldest: one log line a sweep with their number (a
    flood of header-only calls must not become a flood of lines). A call whose own deadline
    passes before its message is logged (no servicer ran to say so)."""
    from openjev.limits import FirstMessage

    first = FirstMessage(most=2, seconds=30)
    with structlog.testing.capture_logs() as lines, _health_behind(first, threads=8) as channel:
        check = channel.stream_unary("/grpc.health.v1.Health/Check", bytes, bytes)
        silent = [check.future(_silent(), timeout=30) for _ in range(5)]
        deadline = time.monotonic() + 10
        while first.waiting() != 2 or sum(not c.running() for c in silent) < 3:
            assert time.monotonic() < deadline, first.waiting()
            time.sleep(0.02)
        late = check.future(_silent(), timeout=0.5)  # the newest: cancels the oldest still waiting
        with pytest.raises(grpc.RpcError) as ended:
            late.result(timeout=10)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(1.5)  # a sweep
        for call in silent:
            call.cancel()
    missing = [line for line in lines if line["event"] == "first_message_missing"]
    counted = [line for line in missing if "calls" in line]
    assert sum(line["calls"] for line in counted) == 4, missing
    assert all(line["status"] == "CANCELLED" and "the oldest cancelled" in line["reason"] for line in counted)
    # the late call (the last silent one, cancelled by the client after 2 s, is logged so too);
    # DEADLINE_EXCEEDED where the server's deadline passed first, CANCELLED where the client's
    # cancel at its own deadline arrived first: the server cannot tell those apart
    own = [line for line in missing if line.get("reason") == "the call ended before its message"]
    own = [line for line in own if line["waited_s"] < 1.5]
    assert len(own) == 1 and own[0]["status"] in ("DEADLINE_EXCEEDED", "CANCELLED"), missing
    assert own[0]["method"] == "/grpc.health.v1.Health/Check" and own[0]["waited_s"] > 0.4


PEER = "ipv4:127.0.0.1:1"  # no real call has this port


class _EndingContext:
    """A call whose client gave up: its read ends as a half-close would, and gRPC marks the call
    inactive a moment later (seen under load on 2026-12-05: the deadline-first call above then
    left no line and was refused INVALID_ARGUMENT as a half-close)."""

    def __init__(self, active_for: float):
        self._until = time.monotonic() + active_for
        self.aborted: tuple | None = None

    def is_active(self) -> bool:
        return time.monotonic() < self._until

    def time_remaining(self) -> float:
        return 0.0

    def peer(self) -> str:
        return PEER

    def abort(self, code, details):
        self.aborted = (code, details)
        raise RuntimeError("aborted")


@pytest.mark.parametrize(
    "active_for, code, logged",
    [
        (0.01, grpc.StatusCode.CANCELLED, ["the call ended before its message"]),
        (10.0, grpc.StatusCode.INVALID_ARGUMENT, []),  # still there: it half-closed without a message
    ],
    ids=["ended", "half-closed"],
)
def test_a_read_that_ends_as_its_call_ends_is_no_half_close(active_for, code, logged):
    from openjev.limits import FirstMessage

    first = FirstMessage(most=4, seconds=30)
    context = _EndingContext(active_for)
    with structlog.testing.capture_logs() as lines, pytest.raises(RuntimeError, match="aborted"):
        first._first(iter(()), context, "/grpc.health.v1.Health/Check")
    assert context.aborted is not None and context.aborted[0] == code
    # this call's lines only: servers of the file's earlier tests may still log their own calls' ends
    mine = [line for line in lines if line["event"] == "first_message_missing" and line.get("peer") == PEER]
    assert [line["reason"] for line in mine] == logged
    assert first.waiting() == 0


CHECK = "/grpc.health.v1.Health/Check"


def _until(done, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_calls_waiting_for_their_message_leave_every_class_its_threads(monkeypatch):
    """The calls FirstMessage lets wait hold a pool thread and a gRPC slot each, outside every
    class's cap: with the pool sized to the caps alone, header-only calls (no token needed) and a
    class at its cap left no thread, so a work call below its cap and health were refused
    `Concurrent RPC limit exceeded` (a review helper's finding)."""
    from openjev import limits, serving

    made: list[limits.FirstMessage] = []

    class Kept(limits.FirstMessage):  # the server's own instance, to see its calls wait
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(serving, "FirstMessage", Kept)
    release, started = threading.Event(), []

    def work(request, context):
        started.append(1)
        release.wait(30)
        return b"done"

    def register(server):
        handlers = {"Work": grpc.unary_unary_rpc_method_handler(work)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", handlers),))

    caps = limits.CallLimits(work=32, watch=1, reflection=1, unary=1, work_methods=("/t.S/Work",))
    server = serving.build_server("127.0.0.1:0", register, [], limits=caps)
    server.set_serving(True)
    address = f"127.0.0.1:{server.port}"
    try:
        with grpc.insecure_channel(address) as hostile, grpc.insecure_channel(address) as channel:
            first = made[0]
            held = [hostile.stream_unary(CHECK, bytes, bytes).future(_silent(), timeout=30) for _ in range(first.most)]
            _until(lambda: first.waiting() == first.most, "the header-only calls wait")
            calls = [channel.unary_unary("/t.S/Work").future(b"x", timeout=30) for _ in range(caps.work)]
            _until(lambda: len(started) == caps.work or any(c.done() for c in calls), "the work calls start")
            refused = [c.exception() for c in calls if c.done()]
            assert not refused, [(e.code(), e.details()) for e in refused]
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            release.set()
            assert [c.result(timeout=10) for c in calls] == [b"done"] * caps.work
            for call in held:
                call.cancel()
    finally:
        release.set()
        server.grpc_server.stop(0)


def test_a_call_is_cancelled_for_the_count_only_after_the_grace():
    """In a burst of valid calls a call counts as waiting from its handler's start until grpcio
    hands it the message: 1,000 health checks at once to a frontend had 2-3 of them CANCELLED, their
    message sent. The count now cancels only calls that waited `grace`; the sweeper takes those
    that were too young when the newer calls came."""
    from openjev.limits import FirstMessage

    first = FirstMessage(most=1, seconds=30, grace=2.0)
    with _health_behind(first, threads=8) as channel:
        check = channel.stream_unary(CHECK, bytes, bytes)
        older = check.future(_silent(), timeout=30)
        _until(lambda: first.waiting() == 1, "the first call waits")
        newer = check.future(_silent(), timeout=30)
        _until(lambda: first.waiting() == 2, "a second call beyond `most` waits, the first still young")
        assert not older.done()
        with pytest.raises(grpc.RpcError) as ended:
            older.result(timeout=10)  # past the grace, the sweeper cancels the oldest beyond the count
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        assert first.waiting() == 1 and not newer.done()
        newer.cancel()


def test_beyond_twice_the_count_the_oldest_is_cancelled_whatever_its_age():
    """The grace must not let a flood of header-only calls (no token needed) outgrow the threads kept
    for waiting calls: at ~935 calls a second a grace of 0.25 s alone left health refused. Beyond
    twice `most` the oldest goes at once, however young."""
    from openjev.limits import FirstMessage

    first = FirstMessage(most=1, seconds=30, grace=30.0)
    with _health_behind(first, threads=8) as channel:
        check = channel.stream_unary(CHECK, bytes, bytes)
        calls = [check.future(_silent(), timeout=30)]
        _until(lambda: first.waiting() == 1, "the first call waits")
        calls.append(check.future(_silent(), timeout=30))
        _until(lambda: first.waiting() == 2, "a second, young, waits beyond `most`")
        calls.append(check.future(_silent(), timeout=30))  # a third: past twice `most`
        with pytest.raises(grpc.RpcError) as ended:
            calls[0].result(timeout=10)
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        _until(lambda: first.waiting() == 2, "the two younger ones wait")
        assert not calls[1].done() and not calls[2].done()
        for call in calls[1:]:
            call.cancel()


def test_malformed_messages_are_logged_once_a_second_with_the_peer():
    """Garbage is free to send, to health Check too (no token): each malformed message was one
    warning line, 1,685 in 1.5 s from one client. Now one a second, counted, with the peer."""
    from openjev import serving

    server = serving.build_server("127.0.0.1:0", lambda s: None, [])
    try:
        with (
            structlog.testing.capture_logs() as lines,
            grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        ):
            check = channel.unary_unary(CHECK, lambda raw: raw, lambda raw: raw)
            for _ in range(50):
                with pytest.raises(grpc.RpcError) as refused:
                    check(b"\xff\xff\xff", timeout=5)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            time.sleep(1.1)  # the throttle's second: the next line says how many were dropped
            with pytest.raises(grpc.RpcError):
                check(b"\xff\xff\xff", timeout=5)
    finally:
        server.grpc_server.stop(0)
    malformed = [line for line in lines if line["event"] == "malformed_request"]
    assert 2 <= len(malformed) <= 4, len(malformed)  # one a second of the run, not one a call
    assert sum(line["dropped"] for line in malformed) + len(malformed) == 51
    assert all(line["peer"].startswith("ipv4:127.0.0.1:") and line["method"] == CHECK for line in malformed)
