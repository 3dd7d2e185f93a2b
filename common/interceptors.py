"""Server interceptors: the request id and per-RPC observation (metrics, log context).

Servicers stay thin: they never make request ids or time themselves. For every intercepted RPC
the interceptor
- takes `x-request-id` from the caller's metadata, or makes one (the frontend, where requests
  enter), and shows it to the servicer as if the caller had sent it, so the servicer's own
  `invocation_metadata()` and everything it passes on to the worker carry the same id;
- shows a call without a deadline as `time_remaining() is None`, so it is passed on as none;
- binds the id into structlog's context, so every log line of that RPC carries it;
- tells an `Observer` when the RPC starts, each response message it sends, and how it ended
  (status code name, seconds), which is where `openjev.metrics` records its series.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

REQUEST_ID_KEY = "x-request-id"
# A caller's request id is taken when it is printable ASCII of at most 128 characters (it goes
# into both servers' log lines and on to the worker as metadata, which refuses control bytes);
# another is made in its place otherwise.
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def valid_request_id(text: str) -> bool:
    return _REQUEST_ID.fullmatch(text) is not None


_NO_DEADLINE_SECONDS = 10 * 365 * 24 * 3600.0


@dataclass
class RequestInfo:
    """What an observer learns about one RPC. kinds: the question kinds the servicer noted
    (empty when it never got that far, e.g. an invalid request)."""

    method: str
    request_id: str
    kinds: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.perf_counter)
    outcome: str | None = None  # set by the servicer where the status code does not say it
    response: Any = None  # the (last) response message, for observers that count answered calls
    server_ended: bool = False  # the servicer cancelled the call itself: not the caller's doing


class Observer:
    """Hooks called on the RPC's own thread; the defaults do nothing."""

    def on_start(self, info: RequestInfo) -> None: ...

    def on_response(self, info: RequestInfo, message) -> None: ...

    def on_end(self, info: RequestInfo, outcome: str, seconds: float) -> None: ...


_current: contextvars.ContextVar[RequestInfo | None] = contextvars.ContextVar("openjev_request", default=None)


def note_kinds(kinds: Iterable[str]) -> None:
    """Called by a servicer once it knows the request's question kinds (a no-op outside an
    intercepted RPC, e.g. a servicer under a plain test server)."""
    info = _current.get()
    if info is not None:
        info.kinds.update(kinds)


def note_outcome(outcome: str, *, server_ended: bool = False) -> None:
    """Called by a servicer whose call ends in a way the status code does not tell (a worker
    stream discarded without a commit: INVALID_ARGUMENT, or CANCELLED where its caller left,
    counted as DISCARDED either way). server_ended: the
    servicer cancelled the call itself, so an inactive call is not a caller that left."""
    info = _current.get()
    if info is not None:
        info.outcome = outcome
        info.server_ended = server_ended


class _IdContext:
    """The servicer's context, with the request id present in the invocation metadata."""

    def __init__(self, context: grpc.ServicerContext, request_id: str):
        self._context = context
        self._metadata = tuple((k, v) for k, v in (context.invocation_metadata() or ()) if k != REQUEST_ID_KEY) + (
            (REQUEST_ID_KEY, request_id),
        )

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self):
        """None when the caller set no deadline. gRPC reports that as about 2**63 seconds,
        which passed on as a timeout overflows into a deadline already past."""
        remaining = self._context.time_remaining()
        return None if remaining is None or remaining > _NO_DEADLINE_SECONDS else remaining

    def __getattr__(self, name):
        return getattr(self._context, name)


# Outcomes of calls the caller ended, not the server: its deadline passed, or it cancelled.
# Alerts on server errors leave them out (docs/deploy.md).
CLIENT_DEADLINE = "DEADLINE_EXCEEDED"
CLIENT_CANCELLED = "CLIENT_CANCELLED"
# A deadline of the server's own (the frontend's --worker-deadline-seconds, shorter than the
# client's): a silent or overloaded worker, which alerts must see.
WORKER_DEADLINE = "WORKER_DEADLINE_EXCEEDED"
# The worker cancelled an Execute stream that sent no commit in time (noted server_ended).
COMMIT_TIMEOUT = "COMMIT_TIMEOUT"
# Calls still running when a server's shutdown grace period ended, cut off by the server (they
# counted as CLIENT_CANCELLED, which alerts leave out: requests lost in a restart went unseen).
SHUTDOWN = "SERVER_SHUTDOWN"
# Set by serving.serve_until_signal as the process's grace period ends; nothing clears it, since
# the process is stopping (in-process servers of the tests never set it).
_grace_over = threading.Event()


def end_of_grace() -> None:
    """From now on a call that ends inactive was cut off by this process's shutdown."""
    _grace_over.set()


def _outcome(context: grpc.ServicerContext, failed: bool, info: RequestInfo) -> str:
    """What the caller saw. The status code alone misreports calls the caller ended: a servicer
    that noticed the cancellation aborts CANCELLED (or never sets a code), whatever the reason."""
    code = context.code()
    if code is None:
        code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
    # a handler that returned after its caller left (or its deadline passed) answered no one
    if code == grpc.StatusCode.OK and not failed and info.outcome is None and context.is_active():
        return code.name
    return ended_outcome(code.name, info, context.time_remaining(), context.is_active())


# A caller's timer fires before the server's copy of its deadline (by the time its request took to
# arrive), so a call its deadline ended can look cancelled with a few ms still remaining here.
DEADLINE_SLACK_SECONDS = 0.1


def refused_outcome(status: str, context: grpc.ServicerContext) -> str:
    """The outcome label a refused call of this request will be counted under (for its log line)."""
    info = _current.get()
    if info is None:
        return status
    return ended_outcome(status, info, context.time_remaining(), context.is_active())


def caller_deadline_passed(remaining: float | None, active: bool) -> bool:
    """Whether the caller's own deadline ended the call (not a cancel of its own)."""
    return remaining is not None and (remaining <= 0 or (not active and remaining <= DEADLINE_SLACK_SECONDS))


def caller_status(status: str, context: grpc.ServicerContext) -> str:
    """A call's status name as its log line, metrics and spans give it: a CANCELLED that the
    caller's own deadline caused (the server saw only its caller gone) is DEADLINE_EXCEEDED."""
    if status == "CANCELLED" and caller_deadline_passed(context.time_remaining(), context.is_active()):
        return "DEADLINE_EXCEEDED"
    return status


def log_status(status: str, context: grpc.ServicerContext) -> dict[str, str]:
    """A refused or abandoned call's log fields, `status` and `outcome`, as its metrics give them."""
    return {"status": caller_status(status, context), "outcome": refused_outcome(status, context)}


def ended_outcome(status: str, info: RequestInfo, remaining: float | None, active: bool) -> str:
    """The outcome label of a call that did not simply end OK (gRPC and the HTTP route): the
    caller's own deadline or cancel first, unless the server ended the call itself."""
    if info.server_ended and info.outcome:
        return info.outcome
    if not active and _grace_over.is_set():
        return SHUTDOWN
    if caller_deadline_passed(remaining, active):
        return CLIENT_DEADLINE
    if not active:
        return CLIENT_CANCELLED
    return info.outcome or status


class RequestInterceptor(grpc.ServerInterceptor):
    """observers: full method name ("/pkg.Service/Method") -> Observer; other methods (health,
    reflection, Describe) pass through untouched. make_ids: give requests without an id one."""

    def __init__(self, observers: Mapping[str, Observer], *, make_ids: bool):
        self._observers = observers
        self._make_ids = make_ids

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        observer = self._observers.get(handler_call_details.method)
        if handler is None or observer is None:
            return handler
        incoming = dict(handler_call_details.invocation_metadata or ()).get(REQUEST_ID_KEY, "")
        if not isinstance(incoming, str) or not valid_request_id(incoming):
            incoming = ""
        method = handler_call_details.method
        make_ids = self._make_ids

        def begin(context) -> tuple[RequestInfo, grpc.ServicerContext, contextvars.Token, Mapping[str, Any]]:
            request_id = incoming or (uuid.uuid4().hex if make_ids else "")
            info = RequestInfo(method, request_id)
            token = _current.set(info)
            bound = structlog.contextvars.bind_contextvars(request_id=request_id)
            observer.on_start(info)
            return info, _IdContext(context, request_id), token, bound

        def end(info, context, token, bound, failed: bool) -> None:
            try:
                observer.on_end(info, _outcome(context, failed, info), time.perf_counter() - info.started)
            finally:
                _reset(token, bound)

        if handler.request_streaming or handler.response_streaming:
            if not handler.response_streaming:
                return handler  # no such method in our protos; leave it alone rather than guess
            behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
            factory = (
                grpc.stream_stream_rpc_method_handler
                if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler
            )

            def streaming(request, context) -> Iterator:
                info, wrapped, token, bound = begin(context)
                failed = True
                try:
                    for message in behavior(request, wrapped):
                        observer.on_response(info, message)
                        yield message
                    failed = False
                finally:
                    end(info, context, token, bound, failed)

            return factory(
                streaming,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        def unary(request, context):
            info, wrapped, token, bound = begin(context)
            failed = True
            try:
                response = handler.unary_unary(request, wrapped)
                observer.on_response(info, response)
                failed = False
                return response
            finally:
                end(info, context, token, bound, failed)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def _reset(token: contextvars.Token, bound: dict) -> None:
    """Undo begin()'s bindings. A streaming RPC abandoned by its client is finalized wherever
    the generator is collected, in another context: then there is nothing of ours to undo."""
    try:
        _current.reset(token)
        structlog.contextvars.reset_contextvars(**bound)
    except ValueError:
        pass


@contextlib.contextmanager
def current_request(info: RequestInfo) -> Iterator[RequestInfo]:
    """Make `info` the current request for a request served outside gRPC (the HTTP route), so
    that the servicer's `note_kinds` reaches it."""
    token = _current.set(info)
    try:
        yield info
    finally:
        _current.reset(token)
