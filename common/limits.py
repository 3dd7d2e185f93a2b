"""Concurrency limits of a gRPC server, so that no kind of call can starve another.

The servers are grpcio's synchronous servers: every open RPC holds one thread until it ends,
idle ones included (a health Watch, a reflection stream, an Execute stream that never commits).
With one shared pool, 32 idle streams took either server down. Here every method belongs to a
class with its own cap, the thread pool has one thread for every capped call of every class,
and gRPC's own `maximum_concurrent_rpcs` equals the pool size, so:

- a call over its class's cap is refused at once with RESOURCE_EXHAUSTED naming the cap (never
  queued invisibly behind busy threads);
- calls of other classes still find a thread: health checks and Describe answer while Decide is
  saturated, and Decide answers while idle Watch/reflection streams are held.

Classes: `work` (Decide, Execute, ExecuteUnary), `watch` (health Watch streams), `reflection`, and `unary`
(everything else: health Check, Describe, DescribeModel). The pool also has threads for the calls
`FirstMessage` lets wait for their message (serving.build_server).

A call of a method that takes one request message holds its slot and thread from its headers on,
while grpcio waits for the message, before any interceptor's code (the caps, the token check)
runs: calls that send headers and nothing more took every slot of the public port, health
included, with no token. `FirstMessage` (outermost) serves such methods as streams that read
their one message themselves, and cancels the oldest calls still waiting for it beyond a few at
once, and any that waited `FIRST_MESSAGE_SECONDS`. Each call cancelled for waiting too long is
logged (`first_message_missing`), as is one whose own deadline or cancel came first; those
cancelled for the count are one line a sweep, with their number (a flood of them, one line each,
would flood the log too).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from openjev import logs

log = logs.get("openjev.limits")

WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")


@dataclass(frozen=True)
class CallLimits:
    """Concurrent calls per class. `work_methods`: full method names of the class `work`."""

    work: int = 64
    watch: int = 32
    reflection: int = 8
    unary: int = 16
    work_methods: tuple[str, ...] = ()

    @property
    def threads(self) -> int:
        """Threads the server needs so that every admitted call has one (+1: the refusal of a
        call over its cap runs on a thread too, briefly)."""
        return self.work + self.watch + self.reflection + self.unary + 1

    def classify(self, method: str) -> str:
        if method in self.work_methods:
            return "work"
        if method == WATCH:
            return "watch"
        if method.startswith(REFLECTION_PREFIXES):
            return "reflection"
        return "unary"

    def validate(self) -> None:
        for name in ("work", "watch", "reflection", "unary"):
            if getattr(self, name) < 1:
                raise ValueError(f"the {name} call limit must be at least 1")


class LimitCalls(grpc.ServerInterceptor):
    """Refuses a call over its class's cap with RESOURCE_EXHAUSTED; counts a call until gRPC
    says it ended (any way: finished, cancelled, deadline), not until its handler returns."""

    def __init__(self, limits: CallLimits):
        limits.validate()
        self.limits = limits
        self._caps = {name: getattr(limits, name) for name in ("work", "watch", "reflection", "unary")}
        self._active = dict.fromkeys(self._caps, 0)
        self._lock = threading.Lock()

    def active(self, name: str) -> int:
        with self._lock:
            return self._active[name]

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        name = self.limits.classify(handler_call_details.method)
        cap = self._caps[name]

        def admit(context) -> None:
            with self._lock:
                if self._active[name] >= cap:
                    admitted = False
                else:
                    self._active[name] += 1
                    admitted = True
            if not admitted:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"server is at its limit of {cap} concurrent {name} calls; retry later",
                )
            released = [False]

            def release() -> None:
                with self._lock:
                    if not released[0]:
                        released[0] = True
                        self._active[name] -= 1

            if not context.add_callback(release):  # already over
                release()

        if handler.request_streaming and handler.response_streaming:

            def stream_stream(requests, context):
                admit(context)
                yield from handler.stream_stream(requests, context)

            return grpc.stream_stream_rpc_method_handler(
                stream_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.response_streaming:

            def unary_stream(request, context):
                admit(context)
                yield from handler.unary_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.request_streaming:

            def stream_unary(requests, context):
                admit(context)
                return handler.stream_unary(requests, context)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, handler.request_deserializer, handler.response_serializer
            )

        def unary_unary(request, context):
            admit(context)
            return handler.unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer
        )


# As long as the HTTP route gives a client to send its body: a 64 MiB message over a slow link
# (10 s is 54 Mbit/s) is a request like any other.
FIRST_MESSAGE_SECONDS = 60.0
# How long a read that ended without a message waits to learn whether its call ended
ENDED_WAIT_SECONDS = 0.05
# A call counts as waiting from its handler's start until grpcio hands it the message, which in a
# burst of valid calls took up to 80 ms (1,000 health checks at once): the count cancels only calls
# that have waited longer than this, or it cancelled calls whose message had come
FIRST_MESSAGE_GRACE_SECONDS = 0.25


class FirstMessage(grpc.ServerInterceptor):
    """Methods with one request message read it under a bound: at most `most` calls wait for it at
    once (a new one beyond that cancels the oldest; a real client's message follows its headers
    within milliseconds, so only calls that send nothing stay waiting; of those, only calls older
    than `grace`, and beyond twice `most` the oldest whatever its age: a flood of header-only calls
    cannot outgrow the threads kept for them), none longer than `seconds` (a sweeper thread, as a
    port whose slots are all held sees no new call; it also cancels by the count those that were
    too young when a call came)."""

    def __init__(self, most: int, seconds: float = FIRST_MESSAGE_SECONDS, grace: float = FIRST_MESSAGE_GRACE_SECONDS):
        self.most, self.seconds, self.grace = max(1, most), seconds, grace
        self._waiting: OrderedDict[int, tuple[float, grpc.ServicerContext, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._next = 0
        self._sweeper: threading.Thread | None = None
        self._evicted = 0  # since the sweeper's last line: a flood of such calls logs once a sweep

    @property
    def hard_most(self) -> int:
        """Waiting calls beyond this many go whatever their age (serving.py keeps their threads)."""
        return 2 * self.most

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        if handler.response_streaming:

            def unary_stream(requests, context):
                yield from handler.unary_stream(self._first(requests, context, method), context)

            return grpc.stream_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )

        def unary_unary(requests, context):
            return handler.unary_unary(self._first(requests, context, method), context)

        return grpc.stream_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer
        )

    def _first(self, requests, context, method: str):
        """The call's one message, or the call cancelled (RpcError) if it does not come in time."""
        with self._lock:
            self._next += 1
            key = self._next
            self._waiting[key] = (time.monotonic(), context, method)
            evicted = self._over_count()
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep, name="first-message", daemon=True)
                self._sweeper.start()
        for _, old, _ in evicted:
            old.cancel()
        try:
            return next(requests)
        except StopIteration:
            # half-closed without a message (what grpcio's own unary read refuses), or ended: a
            # cancelled call's read can end so a moment before gRPC marks the call inactive
            gone_by = time.monotonic() + ENDED_WAIT_SECONDS
            while context.is_active() and time.monotonic() < gone_by:
                time.sleep(0.005)
            if context.is_active():
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request message")
            self._ended(key, context)
            context.abort(grpc.StatusCode.CANCELLED, "the call ended before its message")
        except grpc.RpcError:  # the call ended first: its deadline, the client's cancel, or ours
            self._ended(key, context)
            raise
        finally:
            with self._lock:
                self._waiting.pop(key, None)

    def _over_count(self) -> list[tuple[float, grpc.ServicerContext, str]]:
        """Under the lock: the oldest calls beyond `most` that have waited at least `grace`, and any
        beyond `hard_most`, taken out (counted for the sweeper's line); the caller cancels them."""
        young = time.monotonic() - self.grace
        over, hard = len(self._waiting) - self.most, len(self._waiting) - self.hard_most
        oldest = itertools.islice(self._waiting.items(), max(0, over))
        keys = [key for i, (key, (since, _, _)) in enumerate(oldest) if i < hard or since <= young]
        evicted = [self._waiting.pop(key) for key in keys]
        self._evicted += len(evicted)
        return evicted

    def _ended(self, key: int, context) -> None:
        with self._lock:
            mine = self._waiting.pop(key, None)  # None: cancelled here, and logged so
        if mine is not None:
            remaining = context.time_remaining()
            status = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
            self._log([mine], "the call ended before its message", status)

    def _sweep(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            cutoff = time.monotonic() - self.seconds
            with self._lock:
                late = [key for key, (since, _, _) in self._waiting.items() if since < cutoff]
                expired = [self._waiting.pop(key) for key in late]
                over = self._over_count()
                evicted, self._evicted = self._evicted, 0
            self._log(expired, f"no request message within {self.seconds:g} s", "CANCELLED")
            for _, context, _ in [*expired, *over]:
                context.cancel()
            if evicted:
                reason = f"more than {self.most} calls waited for their request message; the oldest cancelled"
                log.info("first_message_missing", calls=evicted, reason=reason, status="CANCELLED")

    @staticmethod
    def _log(calls: list[tuple[float, grpc.ServicerContext, str]], reason: str, status: str) -> None:
        """No servicer ran for these calls, so no other line says how they ended."""
        now = time.monotonic()
        for since, context, method in calls:
            log.info(
                "first_message_missing",
                method=method,
                peer=context.peer(),
                waited_s=round(now - since, 3),
                reason=reason,
                status=status,
            )
