"""What both gRPC servers share: health, reflection, message-size limits, per-class call limits
(`openjev.limits`), keepalive and idle limits, an exclusively bound port, graceful SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from openjev import interceptors, logs
from openjev.limits import CallLimits, FirstMessage, LimitCalls

log = logs.get("openjev.serving")

# 64 MiB: a request of 65,536 candidates' token ids fits; anything larger is refused by gRPC
# itself with RESOURCE_EXHAUSTED before it reaches a servicer.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# how long before its grace period ends a stopping server counts calls still running as its own cuts
GRACE_MARK_SECONDS = 0.05
# A connection with no call for this long is closed (its client reconnects when it needs to).
MAX_CONNECTION_IDLE_MS = 5 * 60 * 1000
# Servers ping each connection this often and drop it when no answer comes in time, so a vanished
# client's calls end (their threads and call slots free) instead of waiting on TCP.
SERVER_KEEPALIVE_MS = 30_000
SERVER_KEEPALIVE_TIMEOUT_MS = 10_000
# Clients (the frontend's worker channels) may ping this often, during long calls that send no
# data too; below gRPC's default of 5 minutes, which would answer such pings with GOAWAY.
MIN_CLIENT_PING_INTERVAL_MS = 5_000


# A server that is down is tried again within this long (gRPC's default backoff reaches 120 s, and
# calls meanwhile fail UNAVAILABLE at once): an attempt a second to a server that is down costs
# nothing worth saving.
MAX_RECONNECT_BACKOFF_MS = 1000
# A server that stops answering (killed host, SIGSTOP, cut network) is found by pings within
# KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS and its calls fail UNAVAILABLE, instead of waiting on TCP
# (or for good, without a deadline); servers permit pings this often (MIN_CLIENT_PING_INTERVAL_MS).
KEEPALIVE_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def liveness_options() -> list[tuple[str, int]]:
    """A client channel's reconnect backoff and pings: the frontend's worker channels and the
    public client both take these."""
    return [
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # grpcio 1.84 waits for a ping's answer up to ping_timeout_ms (60 s by default), not
        # keepalive_timeout_ms: without it a frozen worker held calls ~70 s
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # else two pings, then one a minute: a unary call sends no data after its request
        ("grpc.http2.max_pings_without_data", 0),
    ]


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


_malformed = logs.Throttle()


class ParseRequests(grpc.ServerInterceptor):
    """Request bytes that are not the method's message (garbage, a string field that is not
    UTF-8) are the caller's fault: INVALID_ARGUMENT naming the message, where gRPC itself would
    answer INTERNAL ("Exception deserializing request!"). Parsing moves into the handler."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def parsed(raw, context):
            try:
                return parse(raw)
            except Exception as error:  # DecodeError, UnicodeDecodeError, ...
                # garbage is free to send, health Check's included (no token): throttled, each counted
                if (dropped := _malformed.admit("malformed")) is not None:
                    log.warning(
                        "malformed_request",
                        method=handler_call_details.method,
                        peer=context.peer(),
                        reason=repr(error),
                        dropped=dropped,
                    )
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message for {handler_call_details.method}"
                )

        if handler.request_streaming:
            behavior = handler.stream_stream or handler.stream_unary

            def run(raw_iterator, context):
                return behavior((parsed(raw, context) for raw in raw_iterator), context)
        else:
            behavior = handler.unary_unary or handler.unary_stream

            def run(raw, context):
                return behavior(parsed(raw, context), context)

        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return factory(run, request_deserializer=None, response_serializer=handler.response_serializer)


@dataclass
class Server:
    grpc_server: grpc.Server
    health: health.HealthServicer
    port: int
    service_names: tuple[str, ...]
    _status: int | None = None

    def set_serving(self, serving: bool) -> None:
        """Health of every service name; a change only (a frontend's link refresh calls this every
        round, and each call would go to every Watch stream)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if status == self._status:
            return
        self._status = status
        for name in ("", *self.service_names):
            self.health.set(name, status)


def server_options(max_message_bytes: int, max_connection_age_seconds: float) -> list[tuple[str, object]]:
    """build_server's gRPC core options (grpcio ignores a name it does not know, silently:
    tests/test_grpc_options.py checks every one against its core)."""
    options: list[tuple[str, object]] = [
        *channel_options(max_message_bytes),
        # Exclusive bind: gRPC sets SO_REUSEPORT by default, and a second server on a busy port
        # then silently shared its connections.
        ("grpc.so_reuseport", 0),
        # No per-connection stream cap (grpc.max_concurrent_streams): under sustained load from
        # 32 clients both servers began refusing every new stream (RST_STREAM REFUSED_STREAM)
        # and never recovered. The per-class call caps below bound the calls in all.
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", SERVER_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        # (core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; the name once written here
        # after the macro was unknown to core, so calls over ~30 s ended `too_many_pings`)
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
        # Identity only (bit 0): gzip let 23 KB on the wire become a 22.5 MiB message of nested
        # arrays, 5 s and 600 MiB of the frontend's, past any proxy's request-size limit. A
        # compressed call is UNIMPLEMENTED; the HTTP route answers 415 likewise.
        ("grpc.compression_enabled_algorithms_bitset", 1),
    ]
    if max_connection_age_seconds > 0:
        options += [
            # gRPC's options are 32-bit: a longer age (30 days ended the start in a traceback) is
            # its longest, ~24.8 days
            ("grpc.max_connection_age_ms", min(int(max_connection_age_seconds * 1000), 2**31 - 1)),
            ("grpc.max_connection_age_grace_ms", 2**31 - 1),
        ]
    return options


class Health(health.HealthServicer):
    """grpcio's health servicer less its leak: a Watch stream's service name stayed a key after
    the stream closed (its set emptied, never removed), so unique names, up to a message each and
    no token needed, grew the process for good (300 names of 4 MB: +1.2 GB)."""

    def _on_close_callback(self, send_response_callback, service):
        def callback():
            with self._lock:
                watchers = self._send_response_callbacks.get(service, set())
                watchers.discard(send_response_callback)
                if not watchers:
                    self._send_response_callbacks.pop(service, None)
            send_response_callback(None)

        return callback

    def end_watches(self) -> None:
        """End every Watch stream (each was just sent NOT_SERVING): the server's stop counts an open
        one as a call in flight, and waited out the whole grace period with nothing else running."""
        with self._lock:
            callbacks = [callback for watchers in self._send_response_callbacks.values() for callback in watchers]
        for callback in callbacks:
            callback(None)


def build_server(
    listen: str,
    register: Callable[[grpc.Server], None],
    service_names: Iterable[str],
    *,
    max_workers: int = 32,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    interceptors: Iterable[grpc.ServerInterceptor] = (),
    max_connection_age_seconds: float = 0.0,
    limits: CallLimits | None = None,
    credentials: grpc.ServerCredentials | None = None,
    program: str = "openjev",
) -> Server:
    """A started server that reports NOT_SERVING until the caller says otherwise.
    max_connection_age_seconds > 0: clients are asked to reconnect that often (in-flight calls
    finish first), so a DNS-named group of workers is re-resolved and new ones get traffic.
    limits: per-class concurrent call caps; the thread pool is sized from them (max_workers
    is used only without limits). credentials: TLS; None serves plaintext."""
    names = tuple(service_names)
    options = server_options(max_message_bytes, max_connection_age_seconds)
    limiter = LimitCalls(limits) if limits is not None else None
    threads = limits.threads if limits is not None else max_workers
    # outermost: no interceptor's code runs before a one-message call's message has come
    first = FirstMessage(most=max(1, threads // 4))
    if limits is not None:  # the calls it lets wait hold a thread and a slot outside every class's cap
        threads += first.hard_most
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
        options=options,
        interceptors=[first, *interceptors, *([limiter] if limiter else []), ParseRequests()],
        # Past this many open calls gRPC answers RESOURCE_EXHAUSTED itself, using no thread:
        # nothing waits unseen in a backlog behind busy threads.
        maximum_concurrent_rpcs=threads if limits is not None else None,
    )
    register(server)
    health_servicer = Health(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    public = (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(public, server, pool=reflection_pool(public))
    try:
        if credentials is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, credentials)
    except RuntimeError:  # grpcio raises when the bind fails
        port = 0
    if port == 0:
        raise SystemExit(f"{program}: cannot listen on {listen}: the address is in use or not available")
    server.start()
    result = Server(server, health_servicer, port, names)
    result.set_serving(False)
    return result


def reflection_pool(service_names: Iterable[str]) -> descriptor_pool.DescriptorPool:
    """A descriptor pool holding only the files that define `service_names` (and what they
    import). Reflection over the default pool would answer for every message this process has
    loaded: the frontend's public port would describe the internal worker schema."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        added.add(file.name)

    default = descriptor_pool.Default()
    for name in service_names:
        add(default.FindServiceByName(name).file)
    return pool


class _StoppedWhileStarting(BaseException):
    """Raised by the start-up SIGTERM handler wherever the main thread was."""


# Set by the start-up handler too: its exception can be swallowed where it lands (seen: inside
# `import torch`'s native init, the worker then serving on), the flag cannot
_signalled_while_starting = threading.Event()


def stop_if_signalled_while_starting() -> None:
    """Call before going SERVING: ends start-up as the signal meant to, where its exception was lost."""
    if _signalled_while_starting.is_set():
        raise _StoppedWhileStarting


@contextlib.contextmanager
def exit_on_signal_while_starting(program: str) -> Iterator[None]:
    """Until serve_until_signal takes over: SIGTERM ends the process (exit 0, nothing to drain).
    In a container the server is PID 1, for which the kernel drops a signal that has no handler,
    so without this a `compose down` during a minutes-long model load waits out the grace period
    and is killed. The handler runs when the main thread next runs Python (within one warm-up
    pass; after a long native call such as a weight read). It only raises: the line is logged
    out here, since the main thread may have been inside the logger (holding its lock) when the
    signal came (a handler that logged hung there, 1 run in ~3 of the test suite). SIGINT (a
    terminal's Ctrl-C) the same: it printed a KeyboardInterrupt traceback and exited -2."""

    def leave(*_) -> None:
        _signalled_while_starting.set()
        raise _StoppedWhileStarting

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, leave)
    try:
        yield
    except (_StoppedWhileStarting, Exception) as error:
        # an error after the signal is the stop too, not a failure to report: an import its
        # exception cut short can fail later (numpy: "cannot load module more than once per process")
        if not isinstance(error, _StoppedWhileStarting) and not _signalled_while_starting.is_set():
            raise
        log.info("shutdown", during="start-up", program=program)
        raise SystemExit(0) from None


def serve_until_signal(
    server: Server,
    *,
    grace_seconds: float,
    on_stop: Callable[[], None] = lambda: None,
    on_signal: Callable[[], None] = lambda: None,
    stop: threading.Event | None = None,
) -> None:
    """Block until SIGTERM/SIGINT (or `stop` is set: the server's own reason to end); then go
    NOT_SERVING, refuse new RPCs, let in-flight ones finish within the grace period, and return.
    on_signal: run at once on the signal (another listener starts draining alongside); on_stop:
    once the gRPC server has stopped."""
    stop = stop or threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if _signalled_while_starting.is_set():  # one whose start-up exception was lost after the last check
        stop.set()
    # Timed waits, not one endless wait: the kernel may deliver the signal to any of the
    # server's threads, and Python runs the handler only when the main thread next runs
    # bytecode, which a main thread blocked in an untimed wait never does (seen: SIGTERM
    # ignored under load, the process serving on).
    while not stop.wait(0.1):
        pass
    log.info("shutdown", grace_seconds=grace_seconds)
    # NOT_SERVING for good: a later set_serving (a frontend's link refresh) changes nothing
    server.health.enter_graceful_shutdown()
    server.health.end_watches()
    on_signal()
    stopped = server.grpc_server.stop(grace_seconds)
    log.info("draining", grace_seconds=grace_seconds)  # new calls are refused from here on
    # calls still running as the grace period ends are cut off by this server, not their callers
    # (marked a moment early: a caller's own cancel in that moment is counted as the server's)
    if not stopped.wait(max(0.0, grace_seconds - GRACE_MARK_SECONDS)):
        interceptors.end_of_grace()
    stopped.wait()
    on_stop()
    log.info("stopped")
