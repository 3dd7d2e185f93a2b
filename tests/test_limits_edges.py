"""The serving limits at their edges: a class's cap exactly, the threads kept for calls waiting
for their message (twice `FirstMessage.most`) and for the refusal of a call over its cap, gRPC's
own limit past them, the grace before a waiting call counts, the throttled malformed-request
warnings, the request-id rule at its bounds and the channel options that must agree.
Real servers on loopback where the behaviour lives in gRPC; the limits objects directly elsewhere."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import NamedTuple

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from openjev import interceptors, limits, logs, serving

CHECK = "/grpc.health.v1.Health/Check"
WORK = "/t.S/Work"
SLOW = "/t.S/Slow"  # a method of the class `unary`
PEER = "ipv4:127.0.0.1:2"  # no real call has this port


def _until(done, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _silent(release: threading.Event) -> Iterator[bytes]:
    """A request stream that sends nothing (headers only) until released."""
    release.wait(60)
    yield b""


def _blocked(first, release: threading.Event) -> Iterator:
    """A request stream that sends `first` and then nothing until released."""
    yield first
    release.wait(60)


class _Server(NamedTuple):
    server: serving.Server
    first: limits.FirstMessage
    started: list
    address: str


def _serve(monkeypatch, caps: limits.CallLimits, release: threading.Event, *, grace: float, extra=()) -> _Server:
    """build_server with a work method and a unary-class method that both block until released, and
    its own FirstMessage (kept, to see its calls wait; `grace` long keeps them waiting)."""
    made: list[limits.FirstMessage] = []

    class Kept(limits.FirstMessage):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, grace=grace)
            made.append(self)

    monkeypatch.setattr(serving, "FirstMessage", Kept)
    started: list[str] = []

    def blocking(name):
        def handler(request, context):
            started.append(name)
            release.wait(30)
            return b"done"

        return grpc.unary_unary_rpc_method_handler(handler)

    def register(server):
        handlers = {"Work": blocking("work"), "Slow": blocking("unary")}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", handlers),))

    server = serving.build_server("127.0.0.1:0", register, [], limits=caps, interceptors=extra)
    server.set_serving(True)
    return _Server(server, made[0], started, f"127.0.0.1:{server.port}")


def _one_by_one(channel: grpc.Channel, methods: list[str], started: list) -> list[grpc.Future]:
    """Each call started once the one before it runs: calls that all wait for their message at once
    beyond twice `most` would cancel the oldest, as a flood of header-only calls does."""
    calls = []
    for count, method in enumerate(methods, start=1):
        calls.append(channel.unary_unary(method).future(b"x", timeout=30))
        _until(lambda count=count: len(started) == count or calls[-1].done(), f"{method} starts")
        assert not calls[-1].done(), (calls[-1].code(), calls[-1].details())
    return calls


def test_with_every_class_at_its_cap_and_twice_most_waiting_a_call_is_refused_by_its_cap(monkeypatch):
    """The pool has a thread for every capped call, for twice `most` calls waiting for their
    message, and one for a refusal: with all of those held, a work call past its cap is refused by
    the cap (its message names it), not by gRPC's own limit, and not admitted; it cancels the
    oldest waiting call, the other waits on."""
    caps = limits.CallLimits(work=2, watch=1, reflection=1, unary=1, work_methods=(WORK,))
    release = threading.Event()
    served = _serve(monkeypatch, caps, release, grace=60.0)
    first = served.first
    try:
        with grpc.insecure_channel(served.address) as hostile, grpc.insecure_channel(served.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            reflecting = stub.ServerReflectionInfo(_blocked(request, release), timeout=30)
            assert next(reflecting).HasField("list_services_response")
            calls = _one_by_one(channel, [SLOW] + [WORK] * caps.work, served.started)
            held = []
            for count in range(1, first.hard_most + 1):
                held.append(hostile.stream_unary(CHECK, bytes, bytes).future(_silent(release), timeout=30))
                _until(lambda count=count: first.waiting() == count, "header-only calls wait, young")
            with pytest.raises(grpc.RpcError) as over:
                channel.unary_unary(WORK)(b"x", timeout=5)
            assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert over.value.details() == "server is at its limit of 2 concurrent work calls; retry later"
            with pytest.raises(grpc.RpcError) as oldest:
                held[0].result(timeout=10)
            assert oldest.value.code() == grpc.StatusCode.CANCELLED
            assert first.waiting() == first.hard_most - 1 and not any(c.done() for c in held[1:])
            release.set()
            assert [c.result(timeout=10) for c in calls] == [b"done"] * 3
            watch.cancel()
            reflecting.cancel()
    finally:
        release.set()
        served.server.grpc_server.stop(0)


class _Stall(grpc.ServerInterceptor):
    """Fault injection: calls of /t.S/Work held before the caps count them, each on its thread."""

    def __init__(self, release: threading.Event):
        self.release, self.holding = release, 0
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler_call_details.method != WORK:
            return handler

        def stall(request, context):
            with self._lock:
                self.holding += 1
            self.release.wait(30)
            return b"stalled"

        return grpc.unary_unary_rpc_method_handler(stall)


def test_past_its_threads_a_call_is_refused_at_once_not_queued(monkeypatch):
    """gRPC's maximum_concurrent_rpcs is the pool size: when every thread is held (here by calls an
    interceptor stalls before the caps), a health check is refused RESOURCE_EXHAUSTED at once
    instead of waiting unseen in the pool's backlog."""
    caps = limits.CallLimits(work=1, watch=1, reflection=1, unary=1, work_methods=(WORK,))
    release = threading.Event()
    stall = _Stall(release)
    served = _serve(monkeypatch, caps, release, grace=60.0, extra=[stall])
    threads = caps.threads + served.first.hard_most
    try:
        with grpc.insecure_channel(served.address) as channel:
            calls = []
            for count in range(1, threads + 1):  # one by one, as above
                calls.append(channel.unary_unary(WORK).future(b"x", timeout=30))
                _until(lambda count=count: stall.holding == count, "every thread is held")
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
            release.set()
            assert [c.result(timeout=10) for c in calls] == [b"stalled"] * threads
    finally:
        release.set()
        served.server.grpc_server.stop(0)


@pytest.mark.parametrize("name", ["work", "watch", "reflection", "unary"])
def test_a_cap_of_zero_is_refused(name):
    """A class capped at 0 refuses every call of it, health checks or Decide included, for good."""
    with pytest.raises(ValueError, match=f"the {name} call limit must be at least 1"):
        limits.LimitCalls(limits.CallLimits(**{name: 0}))
    limits.LimitCalls(limits.CallLimits(**{name: 1}))  # the least that serves


class _Details(NamedTuple):
    method: str
    invocation_metadata: tuple = ()


class _EndedContext:
    """A call that ended before its handler ran: gRPC takes no more callbacks for it."""

    def add_callback(self, callback) -> bool:
        return False

    def abort(self, code, details):
        raise AssertionError(f"refused: {code} {details}")


def test_a_call_that_ended_before_its_handler_gives_its_slot_back():
    """gRPC runs no callback added after a call ended, so that call's slot is given back at once;
    else every such call (a client that cancels at once) kept one, until the class refused all."""
    limiter = limits.LimitCalls(limits.CallLimits(work=1, work_methods=(WORK,)))
    answer = grpc.unary_unary_rpc_method_handler(lambda request, context: b"ok")
    handler = limiter.intercept_service(lambda details: answer, _Details(WORK))
    for _ in range(3):  # at a cap of 1, the second would be refused if the first kept its slot
        assert handler.unary_unary(b"x", _EndedContext()) == b"ok"
    assert limiter.active("work") == 0


class _Waiting:
    """A call's context as FirstMessage uses it while the call waits for its message."""

    def __init__(self):
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def is_active(self) -> bool:
        return not self.cancelled.is_set()

    def time_remaining(self) -> float:
        return 30.0

    def peer(self) -> str:
        return PEER


def _message_when(send: threading.Event, reading: threading.Event | None = None) -> Iterator[bytes]:
    if reading is not None:
        reading.set()
    send.wait(30)
    yield b"message"


def test_a_call_whose_message_is_moments_away_is_not_cancelled_for_the_count():
    """A call counts as waiting from its handler's start until grpcio hands it its message, which
    in a burst of valid calls took up to 80 ms: with the default grace a newer call beyond `most`
    does not cancel an older one still that young, whose message then comes."""
    first = limits.FirstMessage(most=1)
    send_a, send_b, reading_b = threading.Event(), threading.Event(), threading.Event()
    a, b = _Waiting(), _Waiting()
    got: dict[str, bytes] = {}
    older = threading.Thread(target=lambda: got.update(a=first._first(_message_when(send_a), a, CHECK)))
    newer = threading.Thread(target=lambda: got.update(b=first._first(_message_when(send_b, reading_b), b, CHECK)))
    try:
        older.start()
        _until(lambda: first.waiting() == 1, "the older call waits")
        newer.start()
        assert reading_b.wait(10)  # the newer call has counted the waiting calls
        assert not a.cancelled.is_set() and first.waiting() == 2
        send_a.set()
        older.join(10)
        assert got.get("a") == b"message" and not a.cancelled.is_set()
    finally:
        send_a.set()
        send_b.set()
        older.join(10)
        newer.join(10)
    assert got.get("b") == b"message" and first.waiting() == 0


class _Ended(grpc.RpcError):
    pass


class _GoneContext:
    """A call that ended while it waited for its message, `remaining` seconds before its deadline
    as gRPC reports it (never below 0)."""

    def __init__(self, remaining: float | None):
        self.remaining = remaining

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return self.remaining

    def peer(self) -> str:
        return PEER

    def cancel(self) -> None:
        pass


def _ended_read() -> Iterator[bytes]:
    raise _Ended()
    yield b""  # a generator: the read is what raises


@pytest.mark.parametrize(
    "remaining, status", [(0.0, "DEADLINE_EXCEEDED"), (None, "CANCELLED"), (12.5, "CANCELLED")], ids=str
)
def test_a_call_its_deadline_ended_before_its_message_is_logged_deadline_exceeded(remaining, status):
    """gRPC reports a passed deadline as 0 s remaining, never less: the line of a call whose
    deadline came before its message says DEADLINE_EXCEEDED, one its caller cancelled CANCELLED."""
    first = limits.FirstMessage(most=4, seconds=30)
    with structlog.testing.capture_logs() as lines, pytest.raises(_Ended):
        first._first(_ended_read(), _GoneContext(remaining), CHECK)
    mine = [line for line in lines if line["event"] == "first_message_missing" and line.get("peer") == PEER]
    assert [(line["status"], line["reason"]) for line in mine] == [(status, "the call ended before its message")]
    assert first.waiting() == 0


def test_malformed_requests_from_many_connections_are_one_line_a_second(monkeypatch):
    """The warning is throttled for all callers together: garbage from many connections (each a
    peer of its own, no token needed) is still one line a second, not one a connection."""
    monkeypatch.setattr(serving, "_malformed", logs.Throttle(seconds=60))  # no earlier test's line counts
    server = serving.build_server("127.0.0.1:0", lambda s: None, [])
    channels = [grpc.insecure_channel(f"127.0.0.1:{server.port}", [("openjev.test", i)]) for i in range(6)]
    try:
        with structlog.testing.capture_logs() as lines:
            for channel in channels:
                with pytest.raises(grpc.RpcError) as refused:
                    channel.unary_unary(CHECK, lambda raw: raw, lambda raw: raw)(b"\xff\xff\xff", timeout=5)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        for channel in channels:
            channel.close()
        server.grpc_server.stop(0)
    malformed = [line for line in lines if line["event"] == "malformed_request"]
    assert len(malformed) == 1, malformed
    assert malformed[0]["dropped"] == 0 and malformed[0]["peer"].startswith("ipv4:127.0.0.1:")


def test_the_throttle_counts_each_dropped_line_once(monkeypatch):
    """Each logged line says how many of its kind were dropped since the one before it: a count
    carried over from an earlier period would report calls twice. Other kinds are apart."""
    now = [100.0]
    monkeypatch.setattr(logs, "time", SimpleNamespace(monotonic=lambda: now[0]))  # a clock the test moves
    throttle = logs.Throttle(seconds=1.0)
    assert throttle.admit("malformed") == 0
    now[0] += 0.75  # within the period (values exact in binary)
    assert [throttle.admit("malformed") for _ in range(3)] == [None] * 3
    assert throttle.admit("other") == 0
    for dropped in (3, 0):
        now[0] += 1.0  # the throttle's period passes
        assert throttle.admit("malformed") == dropped
    assert throttle.admit("malformed") is None


@pytest.mark.parametrize(
    "text, valid",
    [
        ("x" * 128, True),
        ("x" * 129, False),
        ("", False),
        ("!~", True),  # the ends of printable ASCII
        ("a b", False),
        ("a\x7f", False),  # DEL: a control byte
        ("a\x1f", False),
        ("é", False),
        ("line\n", False),
    ],
    ids=["128", "129", "empty", "ends", "space", "del", "unit-separator", "non-ascii", "newline"],
)
def test_the_request_id_rule_at_its_bounds(text, valid):
    """Printable ASCII, 1 to 128 characters: what both servers log and pass on to the worker."""
    assert interceptors.valid_request_id(text) is valid


def test_the_servers_and_their_clients_agree_on_pings_and_reconnects():
    """Options whose effect only shows after minutes (or with a frozen peer): servers must permit the
    pings clients send (else GOAWAY `too_many_pings` ends calls longer than ~30 s); a client's wait
    for a ping's answer is its keepalive timeout (grpcio's own default is 60 s) and pings go on
    during calls that send no data."""
    from openjev.frontend import worker_link

    server = dict(serving.server_options(serving.MAX_MESSAGE_BYTES, 0.0))
    allowed = server["grpc.http2.min_ping_interval_without_data_ms"]
    for client in (serving.liveness_options(), worker_link.traffic_channel_options()):
        client = dict(client)
        assert client["grpc.keepalive_time_ms"] >= allowed, client
        assert client["grpc.http2.ping_timeout_ms"] == client["grpc.keepalive_timeout_ms"] < 60_000, client
        assert client["grpc.http2.max_pings_without_data"] == 0, client


def test_without_a_connection_age_a_channel_keeps_its_connection():
    """A connection age of 0 (the default) is none: gRPC takes an age of 0 ms as 1 ms, and every
    call then came on a connection of its own."""
    peers: list[str] = []

    def peer(request, context):
        peers.append(context.peer())
        return b""

    def register(server):
        handlers = {"Peer": grpc.unary_unary_rpc_method_handler(peer)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", handlers),))

    server = serving.build_server("127.0.0.1:0", register, [])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for _ in range(4):
                channel.unary_unary("/t.S/Peer")(b"", timeout=5)
                time.sleep(0.1)  # past any age gRPC could have taken
    finally:
        server.grpc_server.stop(0)
    assert len(peers) == 4 and len(set(peers)) == 1, peers


class _CallContext:
    """What RequestInterceptor reads of a call's context."""

    def __init__(self, metadata, remaining):
        self.metadata, self.remaining = metadata, remaining

    def invocation_metadata(self):
        return self.metadata

    def time_remaining(self):
        return self.remaining

    def code(self):
        return None

    def is_active(self) -> bool:
        return True


@pytest.mark.parametrize(
    "sent, kept, remaining, shown",
    [("x" * 128, True, 2.0**63, None), ("x" * 129, False, 7.5, 7.5), ("a\x7fb", False, None, None)],
    ids=["longest-id-no-deadline", "too-long-id", "control-byte-id"],
)
def test_the_servicer_sees_the_callers_id_if_valid_and_no_deadline_as_none(sent, kept, remaining, shown):
    """A valid caller's id reaches the servicer as sent, another is replaced by one made up; a call
    without a deadline (gRPC: ~2**63 s remaining) shows None, which passed on as a timeout
    would overflow into a deadline already past."""
    seen = {}

    def servicer(request, context):
        seen["id"] = dict(context.invocation_metadata())[interceptors.REQUEST_ID_KEY]
        seen["remaining"] = context.time_remaining()
        return b"ok"

    observer = interceptors.RequestInterceptor({WORK: interceptors.Observer()}, make_ids=True)
    metadata = ((interceptors.REQUEST_ID_KEY, sent),)
    handler = observer.intercept_service(
        lambda details: grpc.unary_unary_rpc_method_handler(servicer), _Details(WORK, metadata)
    )
    assert handler.unary_unary(b"x", _CallContext(metadata, remaining)) == b"ok"
    assert seen["remaining"] == shown
    if kept:
        assert seen["id"] == sent
    else:
        assert seen["id"] != sent and len(seen["id"]) == 32 and int(seen["id"], 16) >= 0
