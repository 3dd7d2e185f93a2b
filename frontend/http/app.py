"""The reference HTTP route beside the gRPC API: `POST /v1/systemone`, `GET /health`,
`GET /metrics`, `GET /openapi.json`.

A request takes the very path a gRPC `Decide` takes (`DecisionServicer.answer`: validation,
tokenization streamed to the worker, answers) on a thread of its own, so the answers are the
same bytes; only the transport and the status mapping differ:

| outcome (gRPC code)                        | HTTP |
|--------------------------------------------|------|
| answered (OK)                              | 200  |
| bearer token missing or unknown            | 401  |
| body not `application/json`, or compressed | 415  |
| body over `--http-max-body-bytes`          | 413  |
| body not in within 60 s                    | 408  |
| bad `x-timeout-seconds` header, or two     | 400  |
| two Content-Type headers                   | 400  |
| contract violation (INVALID_ARGUMENT)      | 422, the same message |
| both Content-Length and Transfer-Encoding  | 400  |
| worker queue full (RESOURCE_EXHAUSTED)     | 503 + Retry-After |
| every route thread busy (32 requests)      | 503 + Retry-After |
| bodies held at once past their byte budget | 503 + Retry-After |
| no worker serving (UNAVAILABLE, CANCELLED) | 503 + Retry-After |
| no compatible worker (FAILED_PRECONDITION) | 503 + Retry-After |
| deadline passed (DEADLINE_EXCEEDED)        | 504, also while the body is read |
| the worker failed (INTERNAL, any other)    | 502, no reason: the log has it |
| anything else                              | 500, no internals |

Errors are `{"error": MESSAGE}`; one sent before the request's body was read closes the
connection (`connection: close`), so an unread body is never parsed on as the next request. The
request id is the caller's `x-request-id` (printable ASCII,
at most 128 characters) or a new one, echoed in the response's `x-request-id` either way, as the
gRPC path echoes it in metadata. A client that disconnects cancels the worker's work.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from openjev import interceptors, logs, metrics, tracing
from openjev.client import response_to_json
from openjev.contract.render import dumps_exact
from openjev.frontend.http.openapi import openapi_document
from openjev.frontend.service import DecisionServicer, Refused
from openjev.interceptors import REQUEST_ID_KEY, RequestInfo, valid_request_id
from openjev.security import UNAUTHENTICATED_MESSAGE
from openjev.v1 import decision_pb2 as api

log = logs.get("openjev.frontend")

ROUTE = "/v1/systemone"
RETRY_AFTER_SECONDS = "1"
BODY_SECONDS = 60.0  # to receive a request's body: 64 MiB at ~1 MB/s
BODY_BUDGET_BYTES = 256 << 20  # bodies held at once (at least one of --http-max-body-bytes)
_TIMEOUT_HEADER = "x-timeout-seconds"
MAX_TIMEOUT_SECONDS = 86400.0

# gRPC code of a refusal -> HTTP status; codes not listed are a worker failure (502).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 422,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.FAILED_PRECONDITION: 503,  # no compatible worker (as /health says), nothing failed
}


class HttpCallContext:
    """What the servicer's decide path asks of a gRPC context, for one HTTP request: the time
    left before the caller's deadline, and callbacks run when the caller goes away."""

    def __init__(self, request_id: str, deadline: float | None):
        self._request_id = request_id
        self._deadline = deadline
        self._callbacks: list[Callable[[], None]] = []
        self._cancelled = False
        self._settled = False  # the decide path has its answer: the caller gets it
        self.stopped_by_server = False
        self._lock = threading.Lock()

    def invocation_metadata(self):
        return ((REQUEST_ID_KEY, self._request_id),)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        return not self._cancelled and (self._deadline is None or time.monotonic() < self._deadline)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """As gRPC's: False (the callback not kept) once the call is over; the caller acts."""
        with self._lock:
            if not self._cancelled:
                self._callbacks.append(callback)
            return not self._cancelled

    def cancel(self, by_server: bool = False) -> bool:
        """by_server: the server's shutdown cut the call off (its outcome SERVER_SHUTDOWN). False
        when the answer was settled first: the call is not cut, the caller gets that answer."""
        with self._lock:
            if self._settled:
                return False
            self._cancelled = True
            self.stopped_by_server = self.stopped_by_server or by_server
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
        return True

    def settle(self) -> bool:
        """The decide path has its answer: True when the call was not cut first (then it is
        sent and counted OK), False when it was (then it is counted as the cut's outcome)."""
        with self._lock:
            self._settled = not self._cancelled
            return self._settled


MAX_WORKERS = 32  # the route's threads (Decide blocks one a request), and so its requests at once


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}, ensure_ascii=False).encode()


def _error(status: int, message: str, headers: dict[str, str]) -> Response:
    return Response(_error_body(message), status_code=status, media_type="application/json", headers=headers)


def _early(status: int, message: str, headers: dict[str, str]) -> Response:
    """An error sent before the body was read: the connection closes after it (else the server
    would go on reading and parsing whatever the client still sends, with no time limit)."""
    return _error(status, message, {**headers, "connection": "close"})


def _request_id(request: Request) -> str:
    """The caller's x-request-id when it is a valid one, else a new one."""
    given = request.headers.get(REQUEST_ID_KEY, "")
    return given if valid_request_id(given) else uuid.uuid4().hex


async def _not_routed(request: Request, error: Exception) -> Response:
    """404 and 405 as every other error: a JSON body and the request id."""
    status = getattr(error, "status_code", 404)
    headers = {REQUEST_ID_KEY: _request_id(request)} | dict(getattr(error, "headers", None) or {})  # 405's allow
    message = f"no route {request.url.path}" if status == 404 else f"method {request.method} not allowed here"
    return _early(status, message, headers)


def _is_json(content_type: str | None) -> bool:
    """application/json, with no charset or UTF-8's: JSON is UTF-8 (RFC 8259), and a body declared
    UTF-16 was decoded as UTF-8 and refused 422 "must be valid JSON", as if it were not JSON."""
    media_type, *parameters = (content_type or "").lower().split(";")
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        if name.strip() == "charset" and value.strip().strip('"') not in ("utf-8", "utf8"):
            return False
    return media_type.strip() == "application/json"


class HttpApi:
    """The Starlette app over one servicer. ready(): whether traffic may flow (the worker link
    is compatible and the frontend is not draining); None when it may, else the reason."""

    def __init__(
        self,
        servicer: DecisionServicer,
        ready: Callable[[], str | None],
        *,
        max_body_bytes: int,
        max_workers: int = MAX_WORKERS,
        authorize: Callable[[list[str]], bool] | None = None,
        serve_metrics: bool = False,
    ):
        self.servicer = servicer
        self.ready = ready
        # The public API's bearer-token check, given the request's `authorization` headers (none,
        # one or several); None: no tokens configured. The gRPC port's check (one token set).
        self.authorize = authorize
        self.draining = False  # set on SIGTERM: not ready while requests in flight finish
        self.max_body_bytes = max_body_bytes
        self._too_large = f"request body exceeds {max_body_bytes} bytes"
        # Decide blocks (it streams to the worker over a synchronous channel): one thread each,
        # and no more requests than threads at once: a request past them is refused, not left
        # waiting unseen (in no gauge, its body held) in the pool's queue.
        self._pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="http")
        self.max_concurrent = max_workers
        self._slots = threading.BoundedSemaphore(max_workers)
        # Bodies being received or held, all requests together (the event loop's thread alone
        # changes it): 24 clients sending 63 MiB bodies at once took the process from 0.4 to 1.9 GB.
        self.body_budget = max(BODY_BUDGET_BYTES, max_body_bytes)
        self._body_bytes = 0
        self._observer = metrics.FrontendObserver()
        accepted = sorted(servicer.meta.accepted_model_names)
        document = openapi_document(max_body_bytes, accepted, servicer.max_questions, serve_metrics)
        self._openapi = json.dumps(document).encode()
        self.app = Starlette(
            routes=[
                Route(ROUTE, self.systemone, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                # on the public port only when asked for (--http-metrics): without tokens it would
                # show anyone the worker addresses and process figures
                *([Route("/metrics", self.metrics, methods=["GET"])] if serve_metrics else []),
                Route("/openapi.json", self.openapi, methods=["GET"]),
            ],
            exception_handlers={404: _not_routed, 405: _not_routed},
        )
        self.app.router.redirect_slashes = False  # `/v1/systemone/` is no route, not a redirect to one

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    async def health(self, request: Request) -> Response:
        problem = "the frontend is shutting down" if self.draining else self.ready()
        if problem is None:
            return JSONResponse({"status": "SERVING"})
        if not self.draining and self._unauthorized(request, {}) is not None:
            # the worker link's reasons name worker addresses, kept from callers without a token
            # as /metrics is (the log and --metrics-port have them)
            problem = "no worker is serving"
        return JSONResponse({"status": "NOT_SERVING", "reason": problem}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        # on the public port: behind the tokens where there are any (worker addresses, process
        # figures); --metrics-port serves the same registry on the internal network
        if (refused := self._unauthorized(request, {})) is not None:
            return refused
        return Response(generate_latest(metrics.frontend_registry), media_type=CONTENT_TYPE_LATEST)

    def _unauthorized(self, request: Request, headers: dict[str, str]) -> Response | None:
        """401 where the frontend has tokens and the request carries none of them, else None."""
        if self.authorize is None or self.authorize(request.headers.getlist("authorization")):
            return None
        return _early(401, UNAUTHENTICATED_MESSAGE, {**headers, "www-authenticate": "Bearer"})

    async def openapi(self, request: Request) -> Response:
        # behind the tokens where there are any: it names the accepted models and limits, as
        # DescribeModel does on gRPC, which needs a token
        if (refused := self._unauthorized(request, {})) is not None:
            return refused
        return Response(self._openapi, media_type="application/json")

    async def systemone(self, request: Request) -> Response:
        request_id = _request_id(request)
        headers = {REQUEST_ID_KEY: request_id}
        if (refused := self._unauthorized(request, headers)) is not None:
            peer = f"{request.client.host}:{request.client.port}" if request.client else None
            return self._counted(
                refused, request_id, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE, peer=peer
            )
        # one of each: two that disagree were read as the first, silently (as `authorization` is,
        # a request that carries two is refused)
        for name in ("content-type", _TIMEOUT_HEADER):
            if len(request.headers.getlist(name)) > 1:
                return _early(400, f"a request must carry at most one {name} header", headers)
        if not _is_json(request.headers.get("content-type")):
            return _early(415, "content type must be application/json (UTF-8)", headers)
        # every line of it, as one list (RFC 9110, 5.3): `identity` then `gzip` on two lines was
        # read as its first line, and the gzip bytes parsed as JSON (422 instead of 415)
        codings = [line.strip() for line in request.headers.getlist("content-encoding") if line.strip()] or ["identity"]
        if (encoding := ", ".join(codings).lower()) != "identity":
            # RFC 9110, 15.5.16: a coding the server does not apply is 415, not a body read as it came
            return _early(415, f"content encoding {encoding} is not supported: send the body uncompressed", headers)
        declared = request.headers.get("content-length", "")
        if declared and "transfer-encoding" in request.headers:
            # the body is framed by one of them (h11 takes Transfer-Encoding): a length checked
            # here would not be the length read, so neither is taken (RFC 9112, 6.3)
            return _early(400, "a request must not carry both content-length and transfer-encoding", headers)
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return _early(413, self._too_large, headers)
        deadline = None
        if _TIMEOUT_HEADER in request.headers:
            if not 0 < (seconds := _seconds(request.headers[_TIMEOUT_HEADER])) <= MAX_TIMEOUT_SECONDS:  # nan too
                return _early(
                    400, f"{_TIMEOUT_HEADER} must be a number of seconds in (0, {MAX_TIMEOUT_SECONDS:g}]", headers
                )
            deadline = time.monotonic() + seconds
        # Bodies are charged as their bytes arrive (a declared length that never comes costs
        # nothing: four heads declaring 64 MiB each once shut the route for a minute); one whose
        # declared length does not fit what the others hold now is refused before it is read.
        if self._body_bytes + (int(declared) if declared.isdigit() else 1) > self.body_budget:
            return self._over_budget(request_id, headers)
        held = [0]  # this request's bytes in _body_bytes
        try:
            return await self._receive_and_decide(request, request_id, headers, deadline, held)
        finally:
            self._body_bytes -= held[0]

    def _over_budget(self, request_id: str, headers: dict[str, str]) -> Response:
        busy = f"server is receiving its limit of {self.body_budget} bytes of request bodies; retry later"
        refused = _early(503, busy, {**headers, "retry-after": RETRY_AFTER_SECONDS})
        return self._counted(refused, request_id, grpc.StatusCode.RESOURCE_EXHAUSTED, busy)

    async def _receive_and_decide(
        self, request: Request, request_id: str, headers: dict[str, str], deadline: float | None, held: list[int]
    ) -> Response:
        # The body before a slot, and within a time limit: an upload that stalls holds no slot
        # (32 such clients once held every slot until they disconnected), and ends with 408.
        limit = BODY_SECONDS if deadline is None else min(BODY_SECONDS, max(0.0, deadline - time.monotonic()))
        try:
            body = await asyncio.wait_for(self._read_body(request, held), limit)
        except TimeoutError:
            if limit < BODY_SECONDS:  # the caller's own deadline ended the wait
                late = f"the {_TIMEOUT_HEADER} deadline passed before the body arrived"
                return self._counted(_early(504, late, headers), request_id, grpc.StatusCode.DEADLINE_EXCEEDED, late)
            return _early(408, f"request body not received within {limit:g} s", headers)
        except ClientDisconnect:  # gone before the body arrived: nothing to answer, nothing ran
            return Response(status_code=400)
        if body is _TOO_LARGE:
            return _early(413, self._too_large, headers)
        if body is _OVER_BUDGET:
            return self._over_budget(request_id, headers)
        assert isinstance(body, bytes)
        if not self._slots.acquire(blocking=False):
            busy = f"server is at its limit of {self.max_concurrent} concurrent requests; retry later"
            refused = _error(503, busy, {**headers, "retry-after": RETRY_AFTER_SECONDS})
            return self._counted(refused, request_id, grpc.StatusCode.RESOURCE_EXHAUSTED, busy)
        try:
            return await self._systemone(request, request_id, headers, body, deadline)
        finally:
            self._slots.release()

    def _counted(
        self, response: Response, request_id: str, code: grpc.StatusCode, message: str, **fields: object
    ) -> Response:
        """A refusal before the decide path, counted and logged as the decide path's are (the
        capacity ones are what the RESOURCE_EXHAUSTED series is watched for); `fields`: more for
        its line (a 401's peer)."""
        info = RequestInfo(ROUTE, request_id)
        self._observer.on_start(info)
        self._observer.on_end(info, code.name, 0.0)
        log.info(
            "decide",
            status=code.name,
            outcome=code.name,  # nothing ran: no caller or server cut to tell apart
            http_status=response.status_code,
            reason=message,
            request_id=request_id,
            transport="http",
            **fields,
        )
        return response

    async def _read_body(self, request: Request, held: list[int]) -> bytes | object:
        """The whole body, charged to the budget as it arrives (held[0]: its bytes charged);
        _TOO_LARGE once it passes max_body_bytes, _OVER_BUDGET once the budget has no room."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return _TOO_LARGE
            self._body_bytes += len(chunk)
            held[0] += len(chunk)
            if self._body_bytes > self.body_budget:
                return _OVER_BUDGET
            chunks.append(chunk)
        return b"".join(chunks)

    async def _systemone(
        self, request: Request, request_id: str, headers: dict[str, str], body: bytes, deadline: float | None
    ) -> Response:
        context = HttpCallContext(request_id, deadline)
        trace_headers = {k: v for k, v in request.headers.items() if k in ("traceparent", "tracestate")}
        loop = asyncio.get_running_loop()
        answer = loop.run_in_executor(self._pool, self._decide, body, context, request_id, trace_headers)
        gone = asyncio.ensure_future(_disconnected(request))
        racing: set[asyncio.Future[Any]] = {answer, gone}
        try:
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                context.cancel()  # the caller went away: the worker stops at its next pass boundary
            gone.cancel()
            status, payload, extra = await answer
        except asyncio.CancelledError:  # the server's grace period ran out with this one in flight
            gone.cancel()
            if context.cancel(by_server=True):
                stopping = {**headers, "retry-after": RETRY_AFTER_SECONDS}
                return _error(503, "the server stopped before the request finished; retry", stopping)
            status, payload, extra = await answer  # settled before the cut (and counted so): send it
        return Response(payload, status_code=status, media_type="application/json", headers={**headers, **extra})

    def _decide(
        self, body: bytes, context: HttpCallContext, request_id: str, trace_headers: dict[str, str]
    ) -> tuple[int, bytes, dict[str, str]]:
        """On a pool thread: the servicer's decide path, its outcome as (status, body, headers)."""
        started = time.perf_counter()
        info = RequestInfo(ROUTE, request_id)
        fields: dict = {"request_id": request_id, "transport": "http"}
        bound = structlog.contextvars.bind_contextvars(request_id=request_id)
        outcome = "UNKNOWN"
        self._observer.on_start(info)
        with tracing.server_span(f"POST {ROUTE}", trace_headers) as span:
            try:
                with interceptors.current_request(info):
                    try:
                        text = body.decode("utf-8")
                    except UnicodeDecodeError:
                        text = "\x00"  # not JSON either way: the contract's own message follows
                    response = self.servicer.answer(api.DecideRequest(request_json=text), context, request_id, fields)
                    payload = dumps_exact(response_to_json(response), sort_keys=False).encode()
                    if not context.settle():  # cut off while it was answered: no one gets the answer
                        raise Refused(grpc.StatusCode.CANCELLED, "the call ended before its answer was sent")
                    self._observer.on_response(info, response)
                    outcome = "OK"
                    log.info("decide", status=outcome, http_status=200, latency_ms=_ms(started), **fields)
                    tracing.note_status(span, outcome, 200)
                    return 200, payload, {}
            except Refused as refused:
                context.settle()  # from here a cut no longer changes what the caller gets
                # the metrics' outcome, as on gRPC: who ended the call, not only the status
                remaining, active = context.time_remaining(), context.is_active()
                outcome = (
                    interceptors.SHUTDOWN
                    if context.stopped_by_server
                    else interceptors.ended_outcome(refused.code.name, info, remaining, active)
                )
                if outcome == interceptors.CLIENT_DEADLINE:
                    # the caller's deadline, whichever step it ended (the worker call's message was
                    # "worker: Stream removed (Deadline Exceeded)"); gRPC's Decide reports a cancel
                    # it caused as DEADLINE_EXCEEDED too
                    refused = Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"the {_TIMEOUT_HEADER} deadline passed")
                status = HTTP_STATUS.get(refused.code, 502)
                (log.error if refused.code == grpc.StatusCode.INTERNAL else log.info)(
                    "decide",
                    status=refused.code.name,
                    outcome=outcome,
                    http_status=status,
                    reason=refused.message,
                    latency_ms=_ms(started),
                    **fields,
                )
                tracing.note_status(span, refused.code.name, status)
                extra = {"retry-after": RETRY_AFTER_SECONDS} if status == 503 else {}
                return status, _error_body(refused.public_message(request_id)), extra
            except Exception as error:  # a bug of ours: logged in full, never shown to the caller
                outcome = "INTERNAL"
                log.exception("decide", status=outcome, http_status=500, reason=repr(error), **fields)
                tracing.note_status(span, outcome, 500)
                return 500, _error_body("internal error"), {}
            finally:
                self._observer.on_end(info, outcome, time.perf_counter() - info.started)
                structlog.contextvars.reset_contextvars(**bound)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body is already read, so only that is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


_TOO_LARGE, _OVER_BUDGET = object(), object()  # _read_body's refusals


# No two quantifiers can share a character: `[0-9]+\.?[0-9]*` tried every split of a digit run
# before failing, quadratic (16,000 digits and an `x`: 8 s on the event loop, holding the GIL).
_SECONDS = re.compile(r"\s*(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*")
_SECONDS_CHARS = 64  # ample for any number of seconds this header can hold


def _seconds(text: str) -> float:
    """A header's number of seconds, or -1: a decimal number (float() would also take `1_0`,
    `inf`, `nan` and non-ASCII digits)."""
    return float(text) if len(text) <= _SECONDS_CHARS and _SECONDS.fullmatch(text) else -1.0


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1e3, 3)
