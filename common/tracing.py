"""OpenTelemetry tracing: off unless `configure` is called with an OTLP endpoint (or an exporter).

Off, every helper here is a constant no-op and the opentelemetry packages are never imported, so
a server without `--otlp-endpoint` pays one `if` per span. On, each process exports its spans
over OTLP/gRPC under its own `service.name`, and a request's context crosses processes as W3C
`traceparent` / `tracestate`: in gRPC metadata (frontend -> worker, `inject`/`server_span`) and in
HTTP headers (a caller of the HTTP route).

Code that wants a span writes

    with tracing.span("plan", requests=3) as s:
        ...
        s.set_attribute("passes", n)

which nests under whatever span is current in that thread; an interval that ends on another
thread is a span from `start`, ended there. An exception leaving a span marks it ERROR unless
the span names it a refusal (`refusals`): inside a call only the servers' own failures are
errors, never what the caller caused or ended (its invalid request, its cancel, its deadline).
The opentelemetry packages are the `tracing` extra: `pip install 'openjev-serve[tracing]'`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import grpc

from openjev import interceptors

_tracer: Any = None  # an opentelemetry Tracer while tracing is on
_provider: Any = None


class _NoSpan:
    """What a span is while tracing is off: accepts everything, records nothing."""

    def set_attribute(self, key: str, value: Any) -> None: ...

    def set_attributes(self, attributes: Mapping[str, Any]) -> None: ...

    def record_exception(self, exception: BaseException) -> None: ...

    def end(self) -> None: ...


_NO_SPAN = _NoSpan()
_NO_SPAN_CONTEXT = contextlib.nullcontext(_NO_SPAN)  # reusable: nullcontext keeps no state


def enabled() -> bool:
    return _tracer is not None


EXPORT_TIMEOUT_SECONDS = 2.0


def configure(service_name: str, otlp_endpoint: str | None, *, exporter: Any = None) -> bool:
    """Turn tracing on for this process when an endpoint (e.g. `http://collector:4317`) or an
    exporter is given; returns whether it is on. A missing `tracing` extra is a clear exit."""
    global _tracer, _provider
    if not otlp_endpoint and exporter is None:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as error:
        raise SystemExit(
            f"{service_name}: --otlp-endpoint needs the tracing extra: pip install 'openjev-serve[tracing]' ({error})"
        ) from error
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # An http:// endpoint is plaintext, https:// is TLS (the exporter reads the scheme).
        # a bounded export: an unreachable collector held every SIGTERM exit ~10 s (the default),
        # which a drain near the grace period cannot spare; the exporter's timeout is what bounds
        # it (opentelemetry-sdk 1.45's batch processor ignores export_timeout_millis)
        exporter = OTLPSpanExporter(endpoint=otlp_endpoint, timeout=EXPORT_TIMEOUT_SECONDS)
        provider.add_span_processor(BatchSpanProcessor(exporter, export_timeout_millis=EXPORT_TIMEOUT_SECONDS * 1e3))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _provider = provider
    _tracer = provider.get_tracer("openjev")
    # These two warn once per malformed traceparent/tracestate, with up to 8 KB of the caller's
    # text and neither peer nor request id, before the bearer check: any caller could fill the
    # log (9 MB/s from one client). A bad header is simply not continued.
    for name in ("opentelemetry.trace.span", "opentelemetry.trace.propagation.tracecontext"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return True


def shutdown() -> None:
    """Export what is buffered and turn tracing off (at process stop)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def span(name: str, *, refusals: Mapping[type[BaseException], str] | None = None, **attributes: Any):
    """A context manager: a span current for its block, child of the current one. An exception
    leaving the block marks the span ERROR, with an exception event, unless it is an instance of
    a type in `refusals` (a refusal or the caller's doing, not the server's failure): then its
    gRPC status name there is the span's `openjev.status` and its status stays unset."""
    if _tracer is None:
        return _NO_SPAN_CONTEXT
    if not refusals:
        return _tracer.start_as_current_span(name, attributes=attributes)
    return _refusing_span(name, refusals, attributes)


@contextlib.contextmanager
def _refusing_span(
    name: str, refusals: Mapping[type[BaseException], str], attributes: Mapping[str, Any]
) -> Iterator[Any]:
    from opentelemetry import trace

    with _tracer.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as current:
        try:
            yield current
        except Exception as error:  # as the SDK: not GeneratorExit, KeyboardInterrupt, ...
            code = next((code for kind, code in refusals.items() if isinstance(error, kind)), None)
            if code is not None:
                current.set_attribute("openjev.status", code)
            else:  # what the SDK does for a span without refusals
                current.record_exception(error)
                current.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            raise


def start(name: str, parent: Any = None, **attributes: Any) -> Any:
    """A span that is not made current and is ended by the caller (`.end()`, once), for an
    interval that does not match one block: a wait that ends on another thread, say. parent: a
    span from `start`; default the current context. Its outcome is the caller's to note
    (`note_outcome`)."""
    if _tracer is None:
        return _NO_SPAN
    if isinstance(parent, _OnceSpan):
        from opentelemetry import trace

        parent = trace.set_span_in_context(parent._inner)
    return _OnceSpan(_tracer.start_span(name, context=parent, attributes=attributes))


class _OnceSpan:
    """A span whose end() may be called more than once (the first call counts)."""

    def __init__(self, inner: Any):
        self._inner = inner
        self._ended = False

    def set_attribute(self, key: str, value: Any) -> None:
        self._inner.set_attribute(key, value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self._inner.set_attributes(attributes)

    def record_exception(self, exception: BaseException) -> None:
        self._inner.record_exception(exception)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._inner.end()


def inject(target: Any = None) -> list[tuple[str, str]]:
    """The W3C trace headers of the current span (or of `target`, a span from `start`), as
    gRPC metadata pairs to send along with a call; [] while tracing is off."""
    if _tracer is None:
        return []
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    ctx = None if target is None else trace.set_span_in_context(getattr(target, "_inner", target))
    TraceContextTextMapPropagator().inject(carrier, context=ctx)
    return sorted(carrier.items())


def server_span(name: str, carrier: Mapping[str, str] | None, **attributes: Any):
    """A SERVER span for a request that arrived with `carrier` (HTTP headers or gRPC
    metadata, lower-case keys) continuing the caller's trace when it sent one. Its outcome is
    the caller's to note (`note_status`): an exception leaving it marks nothing."""
    if _tracer is None:
        return _NO_SPAN_CONTEXT
    from opentelemetry import trace

    return _tracer.start_as_current_span(
        name,
        context=_extract(carrier),
        kind=trace.SpanKind.SERVER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    )


# The gRPC codes a server span counts as its own failure (OpenTelemetry's RPC conventions); a
# refusal of the caller's request (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) is not one.
_GRPC_SERVER_ERRORS = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)


def note_status(span: Any, code: str, http_status: int | None = None) -> None:
    """A server span's outcome, as the conventions name it: `rpc.grpc.status_code` (gRPC) or
    `http.response.status_code` (HTTP, `code` then the gRPC status it stands for), and the
    span's status ERROR where the server failed (those codes; HTTP 5xx)."""
    if isinstance(span, _NoSpan):
        return
    from opentelemetry import trace

    if http_status is None:
        span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[code].value[0])
        failed = code in _GRPC_SERVER_ERRORS
    else:
        span.set_attribute("http.response.status_code", http_status)
        failed = http_status >= 500
    span.set_attribute("openjev.status", code)
    if failed:
        span.set_status(trace.Status(trace.StatusCode.ERROR, code))


def note_outcome(span: Any, code: str, *, caller_deadline: bool = False) -> None:
    """An inner span's outcome (a span from `start`): `openjev.status`, a gRPC status name, and
    the span's status ERROR where the server failed, as for a server span, except where the
    caller's own deadline has passed (`caller_deadline`): then a CANCELLED or DEADLINE_EXCEEDED
    is that deadline's doing, noted DEADLINE_EXCEEDED without ERROR (where a deadline of the
    server's own ran out, DEADLINE_EXCEEDED is ERROR)."""
    if isinstance(span, _NoSpan):
        return
    from opentelemetry import trace

    inner = getattr(span, "_inner", span)
    if caller_deadline and code in ("CANCELLED", "DEADLINE_EXCEEDED"):
        inner.set_attribute("openjev.status", "DEADLINE_EXCEEDED")
        return
    inner.set_attribute("openjev.status", code)
    if code in _GRPC_SERVER_ERRORS:
        inner.set_status(trace.Status(trace.StatusCode.ERROR, code))


def _call_code(context: Any, error: BaseException | None) -> str:
    """The status a call handler ended with: its abort's, CANCELLED for a stream its caller
    closed, UNKNOWN for any other exception (gRPC's own), else OK; a CANCELLED that the
    caller's deadline caused (the handler saw its caller gone) is DEADLINE_EXCEEDED, as the
    call's log line and metrics have it (interceptors.caller_status)."""
    code = context.code()
    if code is not None:
        name = code.name
    elif isinstance(error, GeneratorExit):
        name = "CANCELLED"
    else:
        name = "OK" if error is None else "UNKNOWN"
    return interceptors.caller_status(name, context)


def _extract(carrier: Mapping[str, str] | None) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(dict(carrier or {}))


class ServerInterceptor(grpc.ServerInterceptor):
    """A SERVER span around each call of `methods` (full names, "/pkg.Service/Method"),
    continuing the trace the caller sent in its metadata. Added only while tracing is on."""

    def __init__(self, methods: set[str]):
        self._methods = methods

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._methods or _tracer is None:
            return handler
        carrier = {k: v for k, v in handler_call_details.invocation_metadata or () if isinstance(v, str)}
        name = method.lstrip("/")
        if handler.response_streaming:
            behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
            factory = (
                grpc.stream_stream_rpc_method_handler
                if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler
            )

            def streaming(request, context):
                from opentelemetry import context as otel_context
                from opentelemetry import trace

                current = _tracer.start_span(name, context=_extract(carrier), kind=trace.SpanKind.SERVER)
                captured = trace.set_span_in_context(current)
                ended: BaseException | None = None
                # The span stays open over the whole stream; its context is attached around each
                # step only, never across a yield (a stream the client abandons is closed
                # wherever its generator is collected, where there would be nothing to detach).
                responses = behavior(request, context)
                try:
                    while True:
                        token = otel_context.attach(captured)
                        try:
                            message = next(responses)
                        except StopIteration:
                            return
                        finally:
                            otel_context.detach(token)
                        yield message
                except BaseException as error:
                    ended = error
                    raise
                finally:
                    note_status(current, _call_code(context, ended))
                    ended = None  # the error's traceback holds this frame: no cycle back to it
                    current.end()

            return factory(
                streaming,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.request_streaming:
            return handler  # no such method in our protos

        def unary(request, context):
            with server_span(name, carrier) as current:
                ended: BaseException | None = None
                try:
                    return handler.unary_unary(request, context)
                except BaseException as error:
                    ended = error
                    raise
                finally:
                    note_status(current, _call_code(context, ended))
                    ended = None  # the error's traceback holds this frame: no cycle back to it

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
