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
(everything else: health Check, Describe, DescribeModel).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc

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
