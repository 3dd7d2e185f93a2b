"""The HTTP route's edges that a mutation run on frontend/http found unguarded: each gRPC code a
refusal can carry and its HTTP status, a charset spelled `utf8`, the bodies' byte budget (its
floor, its inclusive edge, its refusal counted), the caller's deadline passing before the body
arrived (counted), 408 and 413 mid-body closing the connection, the head deadline of a kept
connection's next request, and /health in the drain. Real servers on loopback, as test_http_route."""

from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

import grpc
import httpx
import pytest
import structlog

from openjev import metrics
from openjev.frontend.http import app as http_app
from openjev.frontend.http.app import HttpApi
from openjev.frontend.http.server import HttpServer
from openjev.frontend.service import Refused

ROUTE = "/v1/systemone"
SMALL = {"state": "hi", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}
JSON_TYPE = {"content-type": "application/json"}


class _Refusing:
    """A servicer that refuses every request with `code` and a message naming what it was sent."""

    meta = SimpleNamespace(accepted_model_names=frozenset({"m"}))
    max_questions = 4

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.code = code
        self.reached = 0

    def answer(self, request, context, request_id, fields):
        self.reached += 1
        raise Refused(self.code, f"refused {len(request.request_json)}")


def _serve(servicer, max_body_bytes: int = 1 << 20) -> tuple[HttpApi, HttpServer]:
    api = HttpApi(servicer, lambda: None, max_body_bytes=max_body_bytes)  # type: ignore[arg-type]
    server = HttpServer(api, "127.0.0.1:0", grace_seconds=1)
    server.start()
    return api, server


def _count(outcome: str) -> float:
    value = metrics.frontend_registry.get_sample_value(
        "openjev_frontend_request_seconds_count", {"kind": "unknown", "outcome": outcome}
    )
    return value or 0.0


def _reply_and_close(connection: socket.socket) -> bytes:
    reply = b""
    while chunk := connection.recv(65536):
        reply += chunk
    return reply


# The route's table, code by code: only a 503 is one to retry (Retry-After); the worker's own
# failure is a 502 without its reason; a code the table does not name is a worker failure too.
@pytest.mark.parametrize(
    ("code", "status", "message"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 422, None),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 503, None),
        (grpc.StatusCode.UNAVAILABLE, 503, None),
        (grpc.StatusCode.CANCELLED, 503, None),
        (grpc.StatusCode.FAILED_PRECONDITION, 503, None),
        # a deadline the servicer did not note as its own (server_ended) is read as the caller's
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "the x-timeout-seconds deadline passed"),
        (grpc.StatusCode.INTERNAL, 502, "model inference failed (request id code-1)"),
        (grpc.StatusCode.UNKNOWN, 502, None),
    ],
    ids=lambda value: getattr(value, "name", str(value)),
)
def test_each_refusal_code_has_its_http_status(code, status, message):
    _, server = _serve(_Refusing(code))
    try:
        reply = httpx.post(
            f"http://127.0.0.1:{server.port}{ROUTE}",
            content=json.dumps(SMALL),
            headers={**JSON_TYPE, "x-request-id": "code-1"},
            timeout=10,
        )
    finally:
        server.wait_stopped()
    assert reply.status_code == status, reply.text
    assert reply.json() == {"error": message or f"refused {len(json.dumps(SMALL))}"}
    assert reply.headers["x-request-id"] == "code-1"
    assert reply.headers.get("retry-after") == ("1" if status == 503 else None)


def test_a_charset_spelled_utf8_is_json():
    """`utf8` is the same charset as `utf-8` (a common spelling): refused 415 it would not be."""
    refusing = _Refusing()
    _, server = _serve(refusing)
    try:
        for content_type in ("application/json; charset=utf8", "application/json;charset=UTF8"):
            reply = httpx.post(
                f"http://127.0.0.1:{server.port}{ROUTE}",
                content=json.dumps(SMALL),
                headers={"content-type": content_type},
                timeout=10,
            )
            assert reply.status_code == 503 and reply.json()["error"].startswith("refused"), (content_type, reply.text)
    finally:
        server.wait_stopped()
    assert refusing.reached == 2


def test_the_body_budget_holds_at_least_one_whole_body(monkeypatch):
    """A --http-max-body-bytes above the budget raises the budget to it: else a body the limit
    allows could never be taken (503 to retry, for good)."""
    monkeypatch.setattr(http_app, "BODY_BUDGET_BYTES", 100)
    refusing = _Refusing()
    api, server = _serve(refusing, max_body_bytes=2000)
    assert api.body_budget == 2000
    body = json.dumps({**SMALL, "state": "x" * 1500})
    try:
        reply = httpx.post(f"http://127.0.0.1:{server.port}{ROUTE}", content=body, headers=JSON_TYPE, timeout=10)
    finally:
        server.wait_stopped()
    assert reply.json() == {"error": f"refused {len(body)}"}  # the decide path had it
    assert refusing.reached == 1


def test_a_refusal_for_the_body_budget_is_counted_and_logged():
    """The budget's 503 is a capacity refusal like the threads' one: counted RESOURCE_EXHAUSTED
    (the series watched for capacity) and logged as a decide line."""
    api, server = _serve(_Refusing())
    api.body_budget = 1000
    before = _count("RESOURCE_EXHAUSTED")
    try:
        with structlog.testing.capture_logs() as lines:
            reply = httpx.post(
                f"http://127.0.0.1:{server.port}{ROUTE}",
                content=json.dumps({**SMALL, "state": "x" * 1200}),
                headers={**JSON_TYPE, "x-request-id": "over-budget"},
                timeout=10,
            )
    finally:
        server.wait_stopped()
    assert reply.status_code == 503 and reply.headers["x-request-id"] == "over-budget"
    assert reply.json()["error"].startswith("server is receiving its limit of 1000 bytes")
    assert _count("RESOURCE_EXHAUSTED") == before + 1
    decided = [(x["status"], x["http_status"]) for x in lines if x.get("request_id") == "over-budget"]
    assert decided == [("RESOURCE_EXHAUSTED", 503)]


def test_a_deadline_that_passes_before_the_body_arrives_is_counted():
    """The caller's deadline ending the body's wait is a 504 counted DEADLINE_EXCEEDED and logged,
    as the same deadline passing later in the decide path is."""
    refusing = _Refusing()
    _, server = _serve(refusing)
    before = _count("DEADLINE_EXCEEDED")
    try:
        with structlog.testing.capture_logs() as lines:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as stalled:
                stalled.sendall(
                    f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "x-request-id: late-body\r\nx-timeout-seconds: 0.3\r\nContent-Length: 100\r\n\r\n{".encode()
                )
                reply = _reply_and_close(stalled)
    finally:
        server.wait_stopped()
    assert reply.startswith(b"HTTP/1.1 504"), reply
    assert reply.endswith(b'{"error": "the x-timeout-seconds deadline passed before the body arrived"}'), reply
    assert refusing.reached == 0
    assert _count("DEADLINE_EXCEEDED") == before + 1
    decided = [(x["status"], x["http_status"]) for x in lines if x.get("request_id") == "late-body"]
    assert decided == [("DEADLINE_EXCEEDED", 504)]


def test_a_body_that_fills_the_budget_exactly_is_taken():
    """The budget is inclusive, as --http-max-body-bytes is: a body of exactly the bytes left is
    read and decided, with a length or chunked; one byte more is the budget's 503."""
    refusing = _Refusing()
    api, server = _serve(refusing)
    body = json.dumps(SMALL).encode()
    api.body_budget = len(body)
    url = f"http://127.0.0.1:{server.port}{ROUTE}"
    try:
        for content in (body, iter([body[:10], body[10:]])):  # a length, chunked
            reply = httpx.post(url, content=content, headers=JSON_TYPE, timeout=10)
            assert reply.json() == {"error": f"refused {len(body)}"}, reply.text
        over = body[:-1] + b" }"
        for content in (over, iter([over[:10], over[10:]])):
            reply = httpx.post(url, content=content, headers=JSON_TYPE, timeout=10)
            assert reply.status_code == 503 and "limit of" in reply.json()["error"], reply.text
    finally:
        server.wait_stopped()
    assert refusing.reached == 2 and api._body_bytes == 0


@pytest.mark.parametrize("refusal", ["408", "413"])
def test_a_refusal_in_the_middle_of_a_body_closes_the_connection(monkeypatch, refusal):
    """408 (the body did not come in time) and 413 (a chunked body ran past the limit) are sent
    with the body unread: the connection closes with them, else the rest of the body was read
    on until a timer ended it, and the client was told nothing of it."""
    monkeypatch.setattr(http_app, "BODY_SECONDS", 0.5)
    _, server = _serve(_Refusing(), max_body_bytes=100)
    chunk = "{" if refusal == "408" else "{" + " " * 200
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as upload:
            upload.sendall(
                f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Transfer-Encoding: chunked\r\n\r\n{len(chunk):x}\r\n{chunk}\r\n".encode()
            )
            started = time.monotonic()
            reply = _reply_and_close(upload)
            assert time.monotonic() - started < 3  # closed by the server with its answer, not by a timer
    finally:
        server.wait_stopped()
    assert reply.startswith(f"HTTP/1.1 {refusal}".encode()), reply
    assert b"\r\nconnection: close\r\n" in reply.lower(), reply


def _health_on(connection: socket.socket) -> bytes:
    """One GET /health on a kept connection: the whole response (its body is short and last)."""
    connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = b""
    while not reply.endswith(b"}"):
        chunk = connection.recv(4096)
        assert chunk, reply  # closed before its answer
        reply += chunk
    return reply


def test_a_kept_connections_next_head_has_the_head_deadline(monkeypatch):
    """After an answer the connection is uvicorn's keep-alive timer's, which stops at the next
    request's first byte: that head needs the guard's deadline again, else half of one held the
    connection for good. The first request outlasts a head deadline (its body comes late), so no
    deadline armed at the connection's start is left to close it."""
    from openjev.frontend.http import guard

    monkeypatch.setattr(guard, "HEAD_SECONDS", 0.5)
    _, server = _serve(_Refusing())
    body = json.dumps(SMALL).encode()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as kept:
            kept.sendall(
                f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
            )
            time.sleep(1.0)  # the body after a head deadline's length: it has the body deadline instead
            kept.sendall(body)
            reply = b""
            while not reply.endswith(b"}"):
                chunk = kept.recv(4096)
                assert chunk, reply  # closed before its answer
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 503") and b"connection: close" not in reply.lower(), reply
            kept.sendall(f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\n".encode())  # half a head, then nothing
            started = time.monotonic()
            assert kept.recv(4096) == b""  # closed by the server (a timeout raises: it was not)
            assert time.monotonic() - started < 5
    finally:
        server.wait_stopped()


def test_a_kept_connections_head_deadline_runs_from_its_first_byte(monkeypatch):
    """The head deadline starts at the head's first byte, not at the answer before it (the idle
    time between is the keep-alive timer's): a head begun 2.5 s after an answer and finished 1 s
    later is taken under a 3 s head deadline (2 s to spare on a loaded machine)."""
    from openjev.frontend.http import guard

    monkeypatch.setattr(guard, "HEAD_SECONDS", 3.0)
    _, server = _serve(_Refusing())
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as kept:
            assert _health_on(kept).startswith(b"HTTP/1.1 200")
            time.sleep(2.5)  # idle, under uvicorn's 5 s keep-alive
            kept.sendall(b"GET /health HTTP/1.1\r\n")
            time.sleep(1.0)  # 3.5 s after the answer, 1 s into the head
            kept.sendall(b"Host: x\r\n\r\n")
            reply = b""
            while not reply.endswith(b"}") and (chunk := kept.recv(4096)):
                reply += chunk
    finally:
        server.wait_stopped()
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"status":"SERVING"}'), reply


def test_the_servers_stop_makes_health_not_ready():
    """begin_stop (the frontend's SIGTERM) marks the route draining: /health says so to whatever
    asks in the drain, before the listener has closed."""
    from starlette.testclient import TestClient

    api, server = _serve(_Refusing())
    try:
        with TestClient(api.app) as client:
            assert client.get("/health").json() == {"status": "SERVING"}
            server.begin_stop()
            reply = client.get("/health")
    finally:
        server.wait_stopped()
    assert reply.status_code == 503
    assert reply.json() == {"status": "NOT_SERVING", "reason": "the frontend is shutting down"}
