"""The HTTP route against a real pair on loopback: the same answers as gRPC, byte for byte, the
same refusal messages, the status codes of the reference service, ids, health, metrics."""

from __future__ import annotations

import gzip
import json
import re
import socket
import ssl
import threading
import time
import uuid
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest
import structlog

from openjev.client import Client
from openjev.frontend.http import app as app_module
from openjev.security import BearerAuth
from openjev.tools import launch, soak
from openjev.tools.soak import log_events
from openjev.v1 import decision_pb2 as api

REPO = Path(__file__).resolve().parents[2]
ROUTE = "/v1/systemone"
ONE_TOKEN = BearerAuth((b"s3cret",)).allowed_headers  # the check the frontend gives its HTTP route


def golden_requests() -> list[dict]:
    cases = json.loads((REPO / "tests" / "contract" / "data" / "contract_cases.json").read_text())["cases"]
    # Their model is the real checkpoint's; the demo export answers to its own names.
    return [{k: v for k, v in case["request"].items() if k != "model"} for case in cases]


def workload_requests() -> list[dict]:
    """Benchmark-shaped requests: the first of every kind x length group up to 512 tokens, the
    multi-question ones and the capacity cases (all but the 16k one, for CPU time)."""
    rows = [json.loads(line) for line in (REPO / "benchmarks" / "workload.jsonl").read_text().splitlines()]
    seen, out = set(), []
    for row in rows:
        key = (row["kind"], row["group"])
        small = row["group"] in ("1-128", "129-512", "3q", "4q") or row["kind"] == "capacity"
        if key not in seen and small and row["group"] != "16k":
            seen.add(key)
            out.append(row["request"])
    return out


def valid_cases() -> list[tuple[dict, str | None]]:
    example = json.loads((REPO / "examples" / "contract_example.json").read_text())
    cases: list[tuple[dict, str | None]] = [(r, None) for r in golden_requests()]
    cases += [(example, policy) for policy in ("off", "shared")]
    cases += soak.valid_requests()
    cases += [(r, None) for r in workload_requests()]
    return cases


def _masked(text: str) -> str:
    """inference_seconds is measured per call; everything else must be the same bytes."""
    masked, count = re.subn(r'"inference_seconds": [0-9.e+-]+', '"inference_seconds": T', text)
    assert count == 1, text[:300]
    return masked


def test_every_case_answers_the_same_bytes_over_http_and_grpc(http_pair, http):
    cases = valid_cases()
    assert len(cases) >= 20
    with Client(http_pair.grpc_address) as client:
        for request, policy in cases:
            body = dict(request, prefix_policy=policy) if policy else request
            over_grpc = client.decide(body, timeout=120)
            reply = http.post(ROUTE, json=body)
            assert reply.status_code == 200, reply.text
            assert reply.headers["content-type"] == "application/json"
            assert list(reply.json()["answers"]) == list(request["questions"])
            assert _masked(reply.text) == _masked(json.dumps(over_grpc, ensure_ascii=False))


def test_a_score_level_with_a_5001_digit_integer_is_answered_with_its_digits(http):
    digits = "9" * 5000 + "1"  # beyond Python's 4,300-digit int <-> str limit
    body = (
        '{"state": "s", "questions": {"s": {"type": "score", "instructions": "how big?", "criteria": [{"n": 0}, {"n": '
        + digits
        + "}]}}}"
    )
    reply = http.post(ROUTE, content=body.encode(), headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    assert '"legend": {"0": {"n": 0}, "1": {"n": ' + digits + "}}" in reply.text


def test_every_refusal_is_422_with_the_grpc_message(http_pair, http):
    cases = soak.invalid_requests() + [
        ('{"state": {"a": 1}, "questions": []}', "questions must be an object"),
        ('{"state": null, "questions": {}}', "state must be text, a JSON object, or an array"),
        ('{"state": "x", "questions": {"q": {"type": "choice", "instructions": "x"}}}', "Choice requires an object"),
    ]
    with Client(http_pair.grpc_address) as client:
        for text, expected in cases:
            with pytest.raises(grpc.RpcError) as caught:
                client.decide(text, timeout=60)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            message = caught.value.details()
            reply = http.post(ROUTE, content=text.encode(), headers={"content-type": "application/json"})
            assert reply.status_code == 422, (text[:80], reply.text)
            assert reply.json() == {"error": message}
            assert message == expected or (expected == "too_long" and "no silent truncation" in message)
    # Bytes that are not UTF-8 cannot be a gRPC string; over HTTP they are not JSON either.
    reply = http.post(ROUTE, content=b'{"state": "\xff"}', headers={"content-type": "application/json"})
    assert reply.status_code == 422 and reply.json() == {"error": "request body must be valid JSON"}


def test_content_type_size_and_timeout_header_are_checked_first(http, max_body_bytes):
    limit = max_body_bytes
    small = b'{"state": "x", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}'
    # a charset other than UTF-8 was ignored: the body decoded as UTF-8 and refused 422 as not JSON
    refused = (None, "text/plain", "application/x-www-form-urlencoded", "application/jsonx")
    for content_type in (*refused, "application/json; charset=utf-16", "application/json;charset=latin-1"):
        headers = {"content-type": content_type} if content_type else {}
        reply = http.post(ROUTE, content=small, headers=headers)
        assert reply.status_code == 415, content_type
        assert reply.json() == {"error": "content type must be application/json (UTF-8)"}
    for content_type in ("Application/JSON; charset=utf-8", 'application/json; charset="UTF-8"', "application/json"):
        ok = http.post(ROUTE, content=small, headers={"content-type": content_type, "content-encoding": ""})
        assert ok.status_code == 200, (content_type, ok.text)  # an empty content-encoding is none
    # a compressed body was parsed as it came, which gave 422 "must be valid JSON" for a valid one
    for encoding, body in (("gzip", gzip.compress(small)), ("br", small)):
        headers = {"content-type": "application/json", "content-encoding": encoding}
        reply = http.post(ROUTE, content=body, headers=headers)
        assert reply.status_code == 415 and reply.json() == {
            "error": f"content encoding {encoding} is not supported: send the body uncompressed"
        }, reply.text
    # two lines are one list: `identity` then `gzip` was read as its first line, and the gzip
    # bytes parsed as JSON (422 "must be valid JSON")
    for lines in (["identity", "gzip"], ["gzip", "identity"]):
        headers = [("content-type", "application/json"), *(("content-encoding", line) for line in lines)]
        reply = http.post(ROUTE, content=gzip.compress(small), headers=headers)
        assert reply.status_code == 415 and reply.json() == {
            "error": f"content encoding {', '.join(lines)} is not supported: send the body uncompressed"
        }, reply.text
    plain = {"content-type": "application/json", "content-encoding": "Identity"}
    assert http.post(ROUTE, content=small, headers=plain).status_code == 200

    too_large = b'{"state": "' + b"x" * limit + b'"}'
    json_type = {"content-type": "application/json"}
    reply = http.post(ROUTE, content=too_large, headers=json_type)
    assert reply.status_code == 413 and str(limit) in reply.json()["error"]
    # Without a Content-Length (chunked), the limit holds as the body arrives.
    reply = http.post(ROUTE, content=iter([too_large[: limit // 2], too_large[limit // 2 :]]))
    assert reply.status_code in (413, 415)
    reply = http.post(ROUTE, content=iter([too_large]), headers=json_type)
    assert reply.status_code == 413

    for value in ("0", "-1", "soon", "nan", "inf"):
        reply = http.post(ROUTE, content=small, headers={**json_type, "x-timeout-seconds": value})
        assert reply.status_code == 400, value
    assert http.post(ROUTE, content=small, headers={**json_type, "x-timeout-seconds": "30"}).status_code == 200
    # A run of digits that fails the number pattern once took time quadratic in its length, on the
    # event loop with the GIL held (16,000 digits: 8 s of the whole frontend, a review 2026-12-04).
    started = time.monotonic()
    reply = http.post(ROUTE, content=small, headers={**json_type, "x-timeout-seconds": "1" * 16_000 + "x"})
    assert reply.status_code == 400 and time.monotonic() - started < 2.0
    # two of a header, which were read as the first
    for twice in (
        [("x-timeout-seconds", "5"), ("x-timeout-seconds", "abc")],
        [("content-type", "application/json")] * 2,
    ):
        name = twice[0][0]
        reply = http.post(
            ROUTE, content=small, headers=[*(json_type.items() if name != "content-type" else ()), *twice]
        )
        assert reply.status_code == 400 and reply.json() == {"error": f"a request must carry at most one {name} header"}


def test_request_id_is_echoed_and_reaches_both_logs(http_pair, http):
    small = {"state": "x", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}
    given = f"http-{uuid.uuid4().hex[:8]}"
    reply = http.post(ROUTE, json=small, headers={"x-request-id": given})
    assert reply.headers["x-request-id"] == given
    refused = http.post(ROUTE, json={"state": "x"}, headers={"x-request-id": given + "-bad"})
    assert refused.status_code == 422 and refused.headers["x-request-id"] == given + "-bad"
    made = http.post(ROUTE, json=small, headers={"x-request-id": "has space"}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    time.sleep(0.3)
    front = [r for r in log_events(http_pair.pair.frontend.log_text(), "decide") if r.get("request_id") == given]
    work = [r for r in log_events(http_pair.pair.worker.log_text(), "execute") if r.get("request_id") == given]
    assert [(r["transport"], r["http_status"], r["status"]) for r in front] == [("http", 200, "OK")]
    assert [r["status"] for r in work] == ["OK"]


def test_health_metrics_and_openapi(http):
    assert http.get("/health").json() == {"status": "SERVING"}
    assert http.post(ROUTE, json=SMALL).status_code == 200  # its own, so the test runs alone too
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    # Requests over HTTP are counted in the same series as gRPC ones.
    assert re.search(r'openjev_frontend_request_seconds_count\{kind="noul",outcome="OK"\} [1-9]', metrics.text)
    document = http.get("/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == {ROUTE, "/health", "/metrics"}
    responses = document["paths"][ROUTE]["post"]["responses"]
    # every status the route's table gives, and 405 (which it gives too)
    assert set(re.findall(r"\| (\d{3})", app_module.__doc__)) | {"405"} <= set(responses)
    assert "retry-after" in responses["503"]["headers"] and "allow" in responses["405"]["headers"]
    not_post = http.get(ROUTE)
    assert not_post.status_code == 405 and "POST" in not_post.headers["allow"]


def test_the_frontends_flags_reach_its_http_port(http_pair, demo_model, tmp_path):
    """A frontend of its own beside the module's worker, with tokens and without --http-metrics:
    its tokens guard the HTTP port, /metrics is no route there, and the document carries its
    --max-questions and its model names. A mutation audit gave the route no token check, or
    /metrics always, in frontend/main.py, and dropped the document's question limit: the suite
    passed each."""
    from openjev.export import load_export_meta

    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    port = launch.free_port()
    flags = ["--http-listen", f"127.0.0.1:{port}", "--auth-token-file", str(tokens), "--max-questions", "7"]
    frontend = launch.start_frontend(demo_model, http_pair.pair.worker.address, tmp_path, flags)
    token = {"authorization": "Bearer s3cret"}
    try:
        launch.wait_serving(frontend.address)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            assert http.post(ROUTE, json=SMALL).status_code == 401
            assert http.get("/openapi.json").status_code == 401
            answered = http.post(ROUTE, json=SMALL, headers=token)
            assert answered.status_code == 200, answered.text
            assert http.get("/metrics", headers=token).status_code == 404  # 200 with the flag: the module's pair
            document = http.get("/openapi.json", headers=token).json()
    finally:
        frontend.stop()
    # "s3cret" is accepted, and said to be short (the count only: tokens are never logged)
    warned = log_events(frontend.log_text(), "short_bearer_tokens")
    assert [w["count"] for w in warned] == [1] and "s3cret" not in frontend.log_text()
    # a 401 on the route is logged with its peer: whom to block
    [unauthorized] = [r for r in log_events(frontend.log_text(), "decide") if r["status"] == "UNAUTHENTICATED"]
    assert unauthorized["peer"].startswith("127.0.0.1:") and unauthorized["http_status"] == 401
    request = document["components"]["schemas"]["DecideRequest"]["properties"]
    assert request["questions"]["maxProperties"] == 7
    assert request["model"]["enum"] == [None, *sorted(load_export_meta(demo_model).accepted_model_names)]


LONG = {
    "state": "word " * 2000,
    "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(16)}}},
    "prefix_policy": "off",
}
SMALL = {"state": "hi", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}
# A quarter of LONG's passes: in flight for long enough where a test waits for its answer too
SHORTER = {
    **LONG,
    "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(4)}}},
}


def _worker_status(pair, request_id: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [r for r in log_events(pair.worker.log_text(), "execute") if r.get("request_id") == request_id]
        if lines:
            return lines[0]["status"]
        time.sleep(0.05)
    raise AssertionError(f"worker logged nothing for {request_id}")


# one sequence a launch, no state cache: a long request keeps the worker busy for seconds, each time
# debug: the worker logs `execute_started` as a request's first pass begins
SLOW_WORKER = ["--max-launch-sequences", "1", "--state-cache-bytes", "0", "--log-level", "debug"]


def wait_started(pair, request_id: str | None = None, timeout: float = 30.0) -> None:
    """Until the worker began running the request (any request when no id is given)."""
    deadline = time.monotonic() + timeout
    while not any(
        request_id in (None, r.get("request_id")) for r in log_events(pair.worker.log_text(), "execute_started")
    ):
        assert time.monotonic() < deadline, f"the worker never started {request_id or 'a request'}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def busy(demo_model, tmp_path_factory, http_pair_factory):
    """One sequence per launch, nothing may wait: a long request keeps the worker busy for seconds
    (each time: no state cache, so a resent long request costs the whole computation again)."""
    started = http_pair_factory(
        demo_model,
        tmp_path_factory.mktemp("http-busy"),
        worker_args=[*SLOW_WORKER, "--queue-capacity", "0"],
    )
    yield started
    started.pair.stop()


def _outcomes(url: str) -> dict[str, float]:
    """The frontend's Decide count by outcome label (HTTP and gRPC together)."""
    return soak.outcome_counts(f"{url}/metrics", "openjev_frontend_request_seconds_count")


def _counted(url: str, before: dict[str, float], outcome: str, timeout: float = 10.0) -> float:
    """How many more calls ended with `outcome` than `before` (waiting for the call to be counted)."""
    deadline = time.monotonic() + timeout
    while (moved := _outcomes(url).get(outcome, 0.0) - before.get(outcome, 0.0)) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return moved


def test_queue_full_is_503_and_a_client_that_leaves_cancels_the_work(busy):
    before = _outcomes(busy.url)
    long_id = f"long-{uuid.uuid4().hex[:8]}"
    body = json.dumps(LONG).encode()
    port = int(busy.url.rsplit(":", 1)[1])
    # A raw connection, so that closing it is exactly a client going away mid-request.
    leaving = socket.create_connection(("127.0.0.1", port))
    leaving.sendall(
        f"POST {ROUTE} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"x-request-id: {long_id}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_started(busy.pair, long_id)
    with httpx.Client(base_url=busy.url, timeout=30) as http:
        reply = http.post(ROUTE, json=SMALL)
        assert reply.status_code == 503, reply.text
        assert reply.headers["retry-after"] == "1"
        assert "queue is full (0 waiting)" in reply.json()["error"]
        closed_at = time.monotonic()
        leaving.close()
        assert _worker_status(busy.pair, long_id) == "CANCELLED"
        assert time.monotonic() - closed_at < 3  # at the next launch boundary, not the end
        assert http.post(ROUTE, json=SMALL).status_code == 200
    # counted as the caller's doing (alerts leave it out), not as a server-side CANCELLED
    assert _counted(busy.url, before, "CLIENT_CANCELLED") == 1
    assert _outcomes(busy.url).get("CANCELLED", 0.0) == before.get("CANCELLED", 0.0)


def test_the_frontends_own_worker_deadline_is_504_counted_as_the_servers(demo_model, tmp_path, http_pair_factory):
    started = http_pair_factory(
        demo_model,
        tmp_path,
        worker_args=SLOW_WORKER,
        frontend_args=["--worker-deadline-seconds", "1.5"],
    )
    try:
        before = _outcomes(started.url)
        with httpx.Client(base_url=started.url, timeout=30) as http:
            reply = http.post(ROUTE, json=LONG)  # no x-timeout-seconds: the frontend's cap ends it
        assert reply.status_code == 504, reply.text
        assert reply.json()["error"].startswith("worker: "), reply.text  # the server's, not the caller's
        assert _counted(started.url, before, "WORKER_DEADLINE_EXCEEDED") == 1
        assert _outcomes(started.url).get("DEADLINE_EXCEEDED", 0.0) == before.get("DEADLINE_EXCEEDED", 0.0)
        with Client(started.grpc_address) as client, pytest.raises(grpc.RpcError) as caught:
            client.decide(LONG, timeout=30)  # the same cap over gRPC
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # the log lines say whose deadline it was, as the metrics do (status alone: DEADLINE_EXCEEDED)
        lines = log_events(started.pair.frontend.log_text(), "decide")
        assert [(line.get("transport"), line["status"], line.get("outcome")) for line in lines] == [
            ("http", "DEADLINE_EXCEEDED", "WORKER_DEADLINE_EXCEEDED"),
            (None, "DEADLINE_EXCEEDED", "WORKER_DEADLINE_EXCEEDED"),
        ], lines
    finally:
        started.pair.stop()


def test_deadline_is_504(busy):
    request_id = f"deadline-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=busy.url, timeout=30) as http:
        started = time.monotonic()
        reply = http.post(ROUTE, json=LONG, headers={"x-timeout-seconds": "1.0", "x-request-id": request_id})
        assert reply.status_code == 504, reply.text
        assert time.monotonic() - started < 5
        # the caller's own deadline, in its terms (it was "worker: Stream removed (Deadline Exceeded)")
        assert reply.json()["error"] == "the x-timeout-seconds deadline passed"
        assert _worker_status(busy.pair, request_id) in ("CANCELLED", "DEADLINE_EXCEEDED")


def test_a_deadline_that_passes_before_tokenizing_is_504_not_503(demo_model, tmp_path, http_pair_factory):
    """16 MB of JSON whitespace: the x-timeout-seconds deadline passes while the body is parsed and
    checked, and the tokenizer then finds the call gone. That was 503 "the client went away ..."
    with Retry-After, the client still waiting (a review, 2026-12-03); gRPC's Decide reports
    DEADLINE_EXCEEDED there."""
    started = http_pair_factory(demo_model, tmp_path, frontend_args=["--http-max-body-bytes", str(32 << 20)])
    body = json.dumps(SMALL)[:-1].encode() + b" " * (16 << 20) + b"}"
    replies = {}
    try:
        with httpx.Client(base_url=started.url, timeout=60) as http:
            for step in range(15):  # deadlines that pass in the body's read, its parse, or not at all
                seconds = f"{0.02 * (step + 1):.2f}"
                headers = {"content-type": "application/json", "x-timeout-seconds": seconds}
                reply = http.post(ROUTE, content=body, headers=headers)
                replies[seconds] = (reply.status_code, reply.json().get("error"))
    finally:
        started.pair.stop()
    assert {code for code, _ in replies.values()} <= {200, 504}, replies
    assert (504, "the x-timeout-seconds deadline passed") in replies.values(), replies  # the path was taken


def test_sigterm_drains_the_request_in_flight(demo_model, tmp_path, http_pair_factory):
    """The HTTP request and a gRPC call in flight finish; the HTTP port is not ready from the
    signal on, not from the gRPC server's stop (a mutation audit left /health 200 SERVING while
    a gRPC call drained, and the suite passed: with an HTTP request alone the gRPC server stops
    at once)."""
    started = http_pair_factory(
        demo_model, tmp_path, worker_args=["--max-launch-sequences", "1"], frontend_args=["--grace-seconds", "30"]
    )
    try:
        with httpx.Client(base_url=started.url, timeout=60) as http, Client(started.grpc_address) as client:
            pool = futures.ThreadPoolExecutor(2)
            running = pool.submit(
                http.post,
                ROUTE,
                json=dict(LONG, questions={"q": {**LONG["questions"]["q"], "criteria": {"a": None, "b": None}}}),
            )
            # 8 criteria: still running 1.2 s in with a 2x margin on this machine (2-3 s with 4)
            longer = dict(
                SHORTER, questions={"q": {**SHORTER["questions"]["q"], "criteria": {f"k{i}": None for i in range(8)}}}
            )
            call = pool.submit(client.decide, longer, timeout=60)
            time.sleep(0.7)
            started.pair.frontend.popen.terminate()
            time.sleep(0.5)
            try:
                health: httpx.Response | None = httpx.get(started.url + "/health", timeout=5)
            except httpx.TransportError:
                health = None  # the listener is closed
            assert not call.done(), "the gRPC call ended before the check: make it longer"
            assert health is None or health.json() == {
                "status": "NOT_SERVING",
                "reason": "the frontend is shutting down",
            }, health.text
            reply = running.result(timeout=60)
            assert reply.status_code == 200, reply.text
            assert list(call.result(timeout=60)["answers"]) == ["q"]
            assert started.pair.frontend.popen.wait(30) == 0
            with pytest.raises(httpx.ConnectError):
                httpx.get(started.url + "/health", timeout=5)
            pool.shutdown()
    finally:
        started.pair.stop()


def test_worker_failure_is_502_and_no_worker_is_503(demo_model, tmp_path):
    from fake_worker import fake_describe, serve_fake

    from openjev.worker.v1 import worker_pb2_grpc

    describe = fake_describe(demo_model)

    class Failing(worker_pb2_grpc.WorkerServiceServicer):
        def Describe(self, request, context):
            return describe

        def Execute(self, request_iterator, context):
            for _ in request_iterator:
                pass
            context.abort(grpc.StatusCode.INTERNAL, "inference failed: device lost")
            yield  # a generator, as the real servicer

    server, worker_port = serve_fake(Failing(), threads=4)
    http_port = launch.free_port()
    frontend = launch.start_frontend(
        demo_model,
        f"127.0.0.1:{worker_port}",
        tmp_path,
        ["--http-listen", f"127.0.0.1:{http_port}", "--worker-refresh-seconds", "0.3"],
    )
    try:
        launch.wait_serving(frontend.address)
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http:
            reply = http.post(ROUTE, json=SMALL, headers={"x-request-id": "lost-1"})
            assert reply.status_code == 502, reply.text
            # the reason stays in the frontend's log, under the id the caller is given
            assert reply.json() == {"error": "model inference failed (request id lost-1)"}
            assert reply.headers["x-request-id"] == "lost-1"
            lines = [r for r in log_events(frontend.log_text(), "decide") if r.get("request_id") == "lost-1"]
            assert [(r["level"], r["http_status"], r["reason"]) for r in lines] == [
                ("error", 502, "worker: inference failed: device lost")
            ]
            server.stop(0)  # no worker any more: not ready, and requests are refused to retry later
            deadline = time.monotonic() + 20
            while http.get("/health").status_code != 503 and time.monotonic() < deadline:
                time.sleep(0.1)
            health_reply = http.get("/health")
            assert health_reply.status_code == 503 and health_reply.json()["status"] == "NOT_SERVING"
            reply = http.post(ROUTE, json=SMALL)
            assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
            assert "unavailable" in reply.json()["error"]
    finally:
        frontend.stop()
        server.stop(0)


def test_a_bug_is_500_without_internals(max_body_bytes):
    """Anything that is not a refusal: the caller learns nothing of it, the log everything."""
    from openjev.frontend.http.app import HttpApi
    from openjev.frontend.http.server import HttpServer

    class Broken:
        meta = SimpleNamespace(accepted_model_names=frozenset({"m"}))
        max_questions = 4

        def answer(self, request, context, request_id, fields):
            raise KeyError("secret internal detail")

    api = HttpApi(Broken(), lambda: None, max_body_bytes=max_body_bytes)  # type: ignore[arg-type]
    server = HttpServer(api, "127.0.0.1:0", grace_seconds=1)
    server.start()
    try:
        reply = httpx.post(f"http://127.0.0.1:{server.port}{ROUTE}", json=SMALL, timeout=10)
        assert reply.status_code == 500
        assert reply.json() == {"error": "internal error"}
        assert "secret" not in reply.text and reply.headers["x-request-id"]
    finally:
        server.wait_stopped()


class _Blocking:
    """A servicer whose answer waits for `release`, then refuses (UNAVAILABLE), or answers
    (an empty response) when `answers`."""

    meta = SimpleNamespace(accepted_model_names=frozenset({"m"}))
    max_questions = 4

    def __init__(self, answers: bool = False) -> None:
        self.release, self.entered = threading.Event(), threading.Event()
        self.answers = answers

    def answer(self, request, context, request_id, fields):
        from openjev.frontend.service import Refused

        self.entered.set()
        self.release.wait(30)
        if self.answers:
            return api.DecideResponse()
        raise Refused(grpc.StatusCode.UNAVAILABLE, "released")


def test_requests_past_the_threads_are_refused_at_once(max_body_bytes):
    """No request waits unseen for a thread (holding its body): past `max_workers` in flight, 503."""
    from openjev.frontend.http.app import HttpApi
    from openjev.frontend.http.server import HttpServer

    slow = _Blocking()
    release, entered = slow.release, slow.entered
    api = HttpApi(slow, lambda: None, max_body_bytes=max_body_bytes, max_workers=1)  # type: ignore[arg-type]
    server = HttpServer(api, "127.0.0.1:0", grace_seconds=1)
    server.start()
    url = f"http://127.0.0.1:{server.port}{ROUTE}"
    try:
        with futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, url, json=SMALL, timeout=30)
            assert entered.wait(10)
            started = time.monotonic()
            refused = httpx.post(url, json=SMALL, timeout=10)
            assert time.monotonic() - started < 2
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"] == "server is at its limit of 1 concurrent requests; retry later"
            release.set()
            assert "released" in first.result().json()["error"]  # the slow one's own answer
        entered.clear()
        again = httpx.post(url, json=SMALL, timeout=10)
        assert entered.is_set() and "released" in again.json()["error"]  # its slot was given back
    finally:
        release.set()
        server.wait_stopped()


def _answering_server(max_body_bytes: int, **options):
    """(api, started server) whose servicer answers at once: a refusal naming `released`."""
    from openjev.frontend.http.app import HttpApi
    from openjev.frontend.http.server import HttpServer

    quick = _Blocking()
    quick.release.set()
    api = HttpApi(quick, lambda: None, max_body_bytes=max_body_bytes, **options)  # type: ignore[arg-type]
    server = HttpServer(api, "127.0.0.1:0", grace_seconds=1)
    server.start()
    return api, server


def _partial_upload(port: int, declared: int, sent: int = 1) -> socket.socket:
    """A connection that sends a request head declaring `declared` body bytes, then `sent` of them."""
    upload = socket.create_connection(("127.0.0.1", port), timeout=10)
    upload.sendall(
        f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n{{".encode()
        + b" " * (sent - 1)
    )
    time.sleep(0.2)
    return upload


def _reply_and_close(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    reply = b""
    while chunk := connection.recv(65536):
        reply += chunk
    return reply


def test_a_stalled_upload_holds_no_thread_and_ends_408(max_body_bytes, monkeypatch):
    """A client that sends headers and then stalls mid-body (32 of them once held every thread
    until they disconnected): the body is read before a thread is taken, within a time limit."""
    from openjev.frontend.http import app as http_app

    monkeypatch.setattr(http_app, "BODY_SECONDS", 1.0)
    _, server = _answering_server(max_body_bytes, max_workers=1)
    try:
        with _partial_upload(server.port, 100) as stalled:
            answered = httpx.post(f"http://127.0.0.1:{server.port}{ROUTE}", json=SMALL, timeout=10)
            assert "released" in answered.json()["error"]  # it had the route's one thread
            reply = b""
            while b"}" not in reply and (chunk := stalled.recv(4096)):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert reply.endswith(b'{"error": "request body not received within 1 s"}'), reply
    finally:
        server.wait_stopped()


@pytest.mark.parametrize("answers", [False, True])
def test_a_request_cut_by_the_grace_period_is_a_json_503(max_body_bytes, answers):
    """A request still running when the HTTP server's grace period (here 0.5 s) ends: cut then,
    not at a rounded second, and answered as a refusal the caller can retry, not a bare 500.
    Its answer computed after the cut reaches no one and is not counted OK."""
    from openjev.frontend.http.app import HttpApi
    from openjev.frontend.http.server import HttpServer

    endless = _Blocking(answers)
    release, entered = endless.release, endless.entered
    api = HttpApi(endless, lambda: None, max_body_bytes=max_body_bytes)  # type: ignore[arg-type]
    ended: list[str] = []
    on_end = api._observer.on_end
    api._observer.on_end = lambda info, outcome, seconds: (ended.append(outcome), on_end(info, outcome, seconds))  # type: ignore[method-assign]
    server = HttpServer(api, "127.0.0.1:0", grace_seconds=0.5)
    server.start()
    try:
        with futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(httpx.post, f"http://127.0.0.1:{server.port}{ROUTE}", json=SMALL, timeout=30)
            assert entered.wait(10)
            stopping = time.monotonic()
            server.wait_stopped()
            assert time.monotonic() - stopping < 0.9  # not rounded up to a second
            cut = reply.result()
        assert cut.status_code == 503 and cut.headers["retry-after"] == "1"
        assert cut.json() == {"error": "the server stopped before the request finished; retry"}
    finally:
        release.set()
        api._pool.shutdown(wait=True)  # its thread ends (and logs) within the test
    # the server cut it off, not its caller (counted CLIENT_CANCELLED, which alerts leave out)
    assert ended == ["SERVER_SHUTDOWN"]


def test_bearer_tokens_when_configured(max_body_bytes):
    """With tokens, a request without a known one is 401 before anything else is looked at."""
    from openjev.frontend.http.app import HttpApi
    from openjev.frontend.http.server import HttpServer

    class Echo:
        meta = SimpleNamespace(accepted_model_names=frozenset({"m"}))
        max_questions = 4

        def answer(self, request, context, request_id, fields):
            from openjev.frontend.service import Refused

            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"reached with {request.request_json}")

    api = HttpApi(Echo(), lambda: None, max_body_bytes=max_body_bytes, authorize=ONE_TOKEN, serve_metrics=True)
    server = HttpServer(api, "127.0.0.1:0", grace_seconds=1)
    server.start()
    url = f"http://127.0.0.1:{server.port}{ROUTE}"
    try:
        twice = [("authorization", "Bearer s3cret"), ("authorization", "Bearer wrong")]
        schemes = [{"authorization": f"{scheme} s3cret"} for scheme in ("Basic", "Token")]
        for headers in (
            {},
            {"authorization": "Bearer wrong"},
            {"authorization": "s3cret"},
            twice,
            twice[::-1],
            *schemes,
        ):
            reply = httpx.post(url, content=b"not even json", headers=headers, timeout=10)
            assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer", headers
            assert reply.json() == {"error": "missing or invalid bearer token"}  # gRPC's message
        reply = httpx.post(
            url,
            content=b"{}",
            headers={"authorization": "Bearer s3cret", "content-type": "application/json"},
            timeout=10,
        )
        assert reply.status_code == 422 and reply.json() == {"error": "reached with {}"}
        # the public port's metrics too (health stays open: load balancers ask it)
        base = f"http://127.0.0.1:{server.port}"
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 401
        metrics = httpx.get(f"{base}/metrics", headers={"authorization": "Bearer s3cret"}, timeout=10)
        assert metrics.status_code == 200 and "openjev_frontend" in metrics.text
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert httpx.get(f"{base}/openapi.json", timeout=10).status_code == 401  # model names, as DescribeModel
        document = httpx.get(f"{base}/openapi.json", headers={"authorization": "Bearer s3cret"}, timeout=10)
        assert document.status_code == 200 and document.json()["openapi"].startswith("3.1")
    finally:
        server.wait_stopped()


def test_a_client_ca_makes_client_certificates_required(max_body_bytes, pki):
    """--tls-client-ca on the HTTP port as on the gRPC one: a client without a certificate signed
    by it is refused in the handshake (a mutation audit that required none passed the suite)."""
    from openjev.frontend.http.app import HttpApi
    from openjev.frontend.http.server import HttpServer

    api = HttpApi(_Blocking(), lambda: None, max_body_bytes=max_body_bytes)  # type: ignore[arg-type]
    tls = {"tls_cert": str(pki["ca-server"]), "tls_key": str(pki["ca-server-key"]), "tls_client_ca": str(pki["ca"])}
    server = HttpServer(api, "127.0.0.1:0", grace_seconds=1, **tls)
    server.start()
    url = f"https://127.0.0.1:{server.port}/health"
    try:
        anonymous = ssl.create_default_context(cafile=str(pki["ca"]))
        with pytest.raises(httpx.TransportError):
            httpx.get(url, verify=anonymous, timeout=10)
        for client in ("other-ca-client", "ca-client"):
            holder = ssl.create_default_context(cafile=str(pki["ca"]))
            holder.load_cert_chain(str(pki[client]), str(pki[f"{client}-key"]))
            if client == "ca-client":
                assert httpx.get(url, verify=holder, timeout=10).status_code == 200
            else:
                with pytest.raises(httpx.TransportError):  # a certificate, but from another CA
                    httpx.get(url, verify=holder, timeout=10)
    finally:
        server.wait_stopped()


def test_a_connection_that_never_finishes_its_head_is_closed(max_body_bytes, monkeypatch):
    """Half a request head (or nothing) held open: closed after the head deadline, so such
    connections cannot pile up until the process runs out of file descriptors."""
    from openjev.frontend.http import guard

    monkeypatch.setattr(guard, "HEAD_SECONDS", 0.5)
    _, server = _answering_server(max_body_bytes)
    try:
        with (
            socket.create_connection(("127.0.0.1", server.port), timeout=10) as silent,
            socket.create_connection(("127.0.0.1", server.port), timeout=10) as halfway,
        ):
            halfway.sendall(f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\n".encode())
            started = time.monotonic()
            assert silent.recv(4096) == b"" and halfway.recv(4096) == b""  # closed by the server
            assert time.monotonic() - started < 5
        answered = httpx.post(f"http://127.0.0.1:{server.port}{ROUTE}", json=SMALL, timeout=10)
        assert "released" in answered.json()["error"]  # a whole request is unaffected
    finally:
        server.wait_stopped()


def test_a_tls_connection_that_never_finishes_its_handshake_is_closed(max_body_bytes, pki, monkeypatch):
    """On a TLS port the head deadline starts after the handshake: a connection that sent nothing
    was held for asyncio's 60 s, so silent connections could again take every file descriptor
    (a review helper's finding). The handshake has the head deadline too."""
    from openjev.frontend.http import guard
    from openjev.frontend.http.app import HttpApi
    from openjev.frontend.http.server import HttpServer

    monkeypatch.setattr(guard, "HEAD_SECONDS", 0.5)
    quick = _Blocking()
    quick.release.set()
    api = HttpApi(quick, lambda: None, max_body_bytes=max_body_bytes)  # type: ignore[arg-type]
    tls = {"tls_cert": str(pki["ca-server"]), "tls_key": str(pki["ca-server-key"])}
    server = HttpServer(api, "127.0.0.1:0", grace_seconds=1, **tls)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as silent:
            started = time.monotonic()
            assert silent.recv(4096) == b""  # closed by the server
            assert time.monotonic() - started < 5
        verify = ssl.create_default_context(cafile=str(pki["ca"]))
        assert httpx.get(f"https://127.0.0.1:{server.port}/health", verify=verify, timeout=10).status_code == 200
    finally:
        server.wait_stopped()


def test_connections_past_the_cap_are_closed_unanswered(max_body_bytes, monkeypatch):
    """Past guard.MAX_CONNECTIONS open connections (here 2) a new one is closed at once."""
    from openjev.frontend.http import guard

    monkeypatch.setattr(guard, "MAX_CONNECTIONS", 2)
    _, server = _answering_server(max_body_bytes)
    address = ("127.0.0.1", server.port)
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    try:
        with socket.create_connection(address, timeout=10) as one, socket.create_connection(address, timeout=10) as two:
            for kept in (one, two):  # answered, and kept open (keep-alive): two connections counted
                kept.sendall(health)
                reply = b""
                while not reply.endswith(b'{"status":"SERVING"}'):
                    reply += kept.recv(4096)
            with socket.create_connection(address, timeout=5) as third:
                try:
                    third.sendall(health)
                    reply = _reply_and_close(third)
                except ConnectionResetError:
                    reply = b""
            assert reply == b""
        deadline = time.monotonic() + 5  # room again once the server sees those two close
        while (answered := _health_status(server.port)) != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert answered == 200
    finally:
        server.wait_stopped()


def _health_status(port: int) -> int | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code
    except httpx.TransportError:
        return None


@pytest.mark.parametrize("framing", ["Content-Length: 1000000000", "Transfer-Encoding: chunked"])
def test_a_body_a_route_does_not_read_cannot_hold_the_connection(max_body_bytes, monkeypatch, framing):
    """GET /health with a declared body, answered, then one body byte: uvicorn stopped its
    keep-alive timer on that byte and the connection stayed open for good (150 such held a
    frontend's port for minutes in a review); the body deadline closes it."""
    from openjev.frontend.http import guard

    monkeypatch.setattr(guard, "BODY_SECONDS", 0.5)
    _, server = _answering_server(max_body_bytes)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as holder:
            holder.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\n{framing}\r\n\r\n".encode())
            head = holder.recv(65536)
            holder.sendall(b"1")
            started = time.monotonic()
            reply = head + _reply_and_close(holder)  # until the server closes (a timeout: it did not)
            assert time.monotonic() - started < 5
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"status":"SERVING"}'), reply
        assert httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10).status_code == 200
    finally:
        server.wait_stopped()


@pytest.mark.parametrize(
    "head",
    [
        b"GET /health HTTP/1.1\r\n\r\n",  # no Host
        b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
    ids=["no-host", "negative-length", "bad-chunk-size"],
)
def test_a_request_h11_cannot_parse_is_a_json_400(max_body_bytes, head):
    """uvicorn answered these in plain text without a request id (one of them chunked)."""
    _, server = _answering_server(max_body_bytes)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as bad:
            bad.sendall(head)
            reply = _reply_and_close(bad)
        status, _, rest = reply.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        fields = dict(line.lower().split(b": ", 1) for line in headers.split(b"\r\n"))
        assert status == b"HTTP/1.1 400 Bad Request", reply
        assert fields[b"content-type"] == b"application/json" and fields[b"connection"] == b"close", reply
        assert re.fullmatch(rb"[0-9a-f]{32}", fields[b"x-request-id"]) and b"transfer-encoding" not in fields, reply
        assert json.loads(body) == {"error": "malformed HTTP request"}
    finally:
        server.wait_stopped()


def test_bodies_held_at_once_have_a_byte_budget(max_body_bytes):
    """Past the bytes of bodies the route holds at once, a request whose declared length does not
    fit is 503 before its body is read; bytes are charged as they arrive, so heads that declare a
    body and never send it hold nothing (four such heads once shut the route for a minute)."""
    api, server = _answering_server(max_body_bytes)
    api.body_budget = 1000
    url = f"http://127.0.0.1:{server.port}{ROUTE}"
    busy = {"error": "server is receiving its limit of 1000 bytes of request bodies; retry later"}
    try:
        with _partial_upload(server.port, 900), _partial_upload(server.port, 900):  # declared, 1 byte sent
            assert "released" in httpx.post(url, json={"state": "x" * 200}, timeout=10).json()["error"]
        with _partial_upload(server.port, 950, sent=900):
            refused = httpx.post(url, json={"state": "x" * 200}, timeout=10)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.headers["connection"] == "close" and refused.json() == busy
            assert "released" in httpx.post(url, json=SMALL, timeout=10).json()["error"]  # within the rest
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as chunked:
                # no declared length: refused once its bytes pass the room left
                chunked.sendall(
                    f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Transfer-Encoding: chunked\r\n\r\n{200:x}\r\n{'x' * 200}\r\n".encode()
                )
                reply = _reply_and_close(chunked)
            assert reply.startswith(b"HTTP/1.1 503") and reply.endswith(json.dumps(busy).encode()), reply
        deadline = time.monotonic() + 10  # the server sees the upload's connection close
        while api._body_bytes != 0:
            assert time.monotonic() < deadline, api._body_bytes
            time.sleep(0.02)
    finally:
        server.wait_stopped()


def test_the_checks_before_the_decide_path_hold_at_their_edges(max_body_bytes):
    """Each at its edge (a mutation audit moved each by one, or took it out, and the suite
    passed): a body of exactly --http-max-body-bytes is taken, with a length or chunked, and one
    byte more is 413; a length declared past the bodies' budget is 413 at once, not the budget's
    503; x-timeout-seconds is taken up to 86400; application/json only, not any type ending in
    json; /health while draining is 503 with its reason."""
    api, server = _answering_server(max_body_bytes)
    url = f"http://127.0.0.1:{server.port}{ROUTE}"
    json_type = {"content-type": "application/json"}
    taken = (503, {"error": "released"})  # the decide path's own answer: the checks let it through
    try:
        body = json.dumps(SMALL)[:-1].encode()
        body += b" " * (max_body_bytes - len(body) - 1) + b"}"
        assert len(body) == max_body_bytes
        for extra, expected in ((b"", taken), (b" ", (413, {"error": f"request body exceeds {max_body_bytes} bytes"}))):
            for content in (body + extra, iter([body[:10], body[10:] + extra])):  # a length, chunked
                reply = httpx.post(url, content=content, headers=json_type, timeout=10)
                assert (reply.status_code, reply.json()) == expected, (len(extra), reply.text)

        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as declared:
            declared.sendall(
                f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {api.body_budget + 1}\r\n\r\n{{".encode()
            )
            reply = _reply_and_close(declared)
        assert reply.startswith(b"HTTP/1.1 413"), reply

        bound = {"error": "x-timeout-seconds must be a number of seconds in (0, 86400]"}
        for seconds, expected in (("86400", taken), ("86400.5", (400, bound)), ("1e9", (400, bound))):
            reply = httpx.post(url, json=SMALL, headers={"x-timeout-seconds": seconds}, timeout=10)
            assert (reply.status_code, reply.json()) == expected, seconds

        for content_type in ("text/json", "application/problem+json", "application/x-ndjson; x=json"):
            reply = httpx.post(url, content=json.dumps(SMALL), headers={"content-type": content_type}, timeout=10)
            assert reply.status_code == 415, content_type

        api.draining = True
        reply = httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
        assert reply.status_code == 503
        assert reply.json() == {"status": "NOT_SERVING", "reason": "the frontend is shutting down"}
    finally:
        server.wait_stopped()


def test_a_length_and_a_chunked_body_at_once_are_refused(max_body_bytes):
    """With both headers the body is read by Transfer-Encoding, so a Content-Length checked
    against the limits says nothing (it once let 12 bodies of 60 MiB past a 256 MiB budget)."""
    _, server = _answering_server(max_body_bytes)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as both:
            both.sendall(
                f"POST {ROUTE} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{}  \r\n".encode()
            )
            reply = _reply_and_close(both)  # closed after the answer, the rest of the body unread
        assert reply.startswith(b"HTTP/1.1 400"), reply
        assert b"connection: close" in reply.lower()
        assert reply.endswith(b'{"error": "a request must not carry both content-length and transfer-encoding"}')
    finally:
        server.wait_stopped()


@pytest.mark.parametrize("refusal", ["415", "404", "401"])
def test_a_refusal_before_the_body_closes_the_connection(max_body_bytes, refusal):
    """An answer sent before the body was read closes the connection: otherwise the server went
    on reading and parsing whatever the client sent next, a byte every few seconds, for good."""
    from openjev.frontend.http.app import HttpApi
    from openjev.frontend.http.server import HttpServer

    quick = _Blocking()
    quick.release.set()
    authorize = ONE_TOKEN if refusal == "401" else None
    api = HttpApi(quick, lambda: None, max_body_bytes=max_body_bytes, authorize=authorize)  # type: ignore[arg-type]
    server = HttpServer(api, "127.0.0.1:0", grace_seconds=1)
    server.start()
    path, content_type = {"415": (ROUTE, "text/plain"), "404": ("/nowhere", "application/json")}.get(
        refusal, (ROUTE, "application/json")
    )
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as trickle:
            trickle.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                "Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n".encode()
            )
            started = time.monotonic()
            reply = _reply_and_close(trickle)
            assert time.monotonic() - started < 5
        assert reply.startswith(f"HTTP/1.1 {refusal}".encode()), reply
        assert b"connection: close" in reply.lower()
    finally:
        server.wait_stopped()


def test_health_names_no_worker_address_to_a_caller_without_a_token(max_body_bytes):
    """/health stays open (load balancers ask it), but with tokens configured its reason for 503
    says only that no worker serves; a caller with a token gets the link's own reason."""
    from openjev.frontend.http.app import HttpApi
    from openjev.frontend.http.server import HttpServer

    reason = "no worker at 10.0.0.1:50052 is serving: worker at 10.0.0.1:50052 is unavailable"
    authorize = ONE_TOKEN
    api = HttpApi(_Blocking(), lambda: reason, max_body_bytes=max_body_bytes, authorize=authorize)  # type: ignore[arg-type]
    server = HttpServer(api, "127.0.0.1:0", grace_seconds=1)
    server.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        anonymous = httpx.get(f"{base}/health", timeout=10)
        assert anonymous.status_code == 503
        assert anonymous.json() == {"status": "NOT_SERVING", "reason": "no worker is serving"}
        holder = httpx.get(f"{base}/health", headers={"authorization": "Bearer s3cret"}, timeout=10)
        assert holder.status_code == 503 and holder.json()["reason"] == reason
    finally:
        server.wait_stopped()


def test_max_concurrent_requests_caps_the_http_route_too(demo_model, tmp_path, http_pair_factory):
    """--max-concurrent-requests 1: with one HTTP request in flight, the next is refused at once
    (the route had its own 32 threads whatever the flag said)."""
    started = http_pair_factory(
        demo_model,
        tmp_path,
        worker_args=SLOW_WORKER,
        frontend_args=["--max-concurrent-requests", "1"],
    )
    try:
        with httpx.Client(base_url=started.url, timeout=60) as http, futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(http.post, ROUTE, json=SHORTER)
            wait_started(started.pair)  # a second of work or more, one sequence a launch
            refused = http.post(ROUTE, json=SMALL)
            assert refused.status_code == 503, (refused.text, "first request already done" if long.done() else "")
            assert refused.json()["error"] == "server is at its limit of 1 concurrent requests; retry later"
            assert long.result().status_code == 200
            assert http.post(ROUTE, json=SMALL).status_code == 200
    finally:
        started.pair.stop()


def test_metrics_are_on_the_public_port_only_when_asked_for(max_body_bytes):
    """Without --http-metrics (and without tokens, as the compose and Kubernetes files run) the
    public port served the whole registry, worker addresses included, to anyone."""
    api, server = _answering_server(max_body_bytes)
    try:
        base = f"http://127.0.0.1:{server.port}"
        reply = httpx.get(f"{base}/metrics", timeout=10)
        assert reply.status_code == 404 and reply.json() == {"error": "no route /metrics"}
        assert "/metrics" not in httpx.get(f"{base}/openapi.json", timeout=10).json()["paths"]
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    finally:
        server.wait_stopped()


def test_no_route_and_wrong_method_are_json_with_the_request_id(http):
    """404 and 405 answer as every other error: {"error": ...} and the id; a trailing slash is no
    route (it was a redirect to an absolute http:// URL)."""
    for method, path, status in (("GET", ROUTE, 405), ("OPTIONS", ROUTE, 405), ("GET", "/nowhere", 404)):
        reply = http.request(method, path, headers={"x-request-id": "r-404"})
        assert reply.status_code == status and reply.headers["x-request-id"] == "r-404", (method, path)
        assert reply.headers["content-type"] == "application/json" and set(reply.json()) == {"error"}
    assert http.request("GET", ROUTE).headers["allow"] == "POST"
    slash = http.post(ROUTE + "/", json=SMALL)
    assert slash.status_code == 404 and slash.json() == {"error": f"no route {ROUTE}/"}
    assert http.get("/nowhere").headers["x-request-id"]  # made up: none was sent


def _count(outcome: str) -> float:
    from openjev import metrics

    value = metrics.frontend_registry.get_sample_value(
        "openjev_frontend_request_seconds_count", {"kind": "unknown", "outcome": outcome}
    )
    return value or 0.0


def test_refusals_before_the_decide_path_are_counted_and_logged(max_body_bytes):
    """401 and the all-threads-busy 503 are counted in the request series (the capacity signal
    RESOURCE_EXHAUSTED is watched for) and logged as decide lines, as the other refusals are."""
    from openjev.frontend.http.app import HttpApi
    from openjev.frontend.http.server import HttpServer

    slow = _Blocking()
    authorize = ONE_TOKEN
    api = HttpApi(slow, lambda: None, max_body_bytes=max_body_bytes, max_workers=1, authorize=authorize)  # type: ignore[arg-type]
    server = HttpServer(api, "127.0.0.1:0", grace_seconds=1)
    server.start()
    url = f"http://127.0.0.1:{server.port}{ROUTE}"
    before = {o: _count(o) for o in ("UNAUTHENTICATED", "RESOURCE_EXHAUSTED")}
    token = {"authorization": "Bearer s3cret"}
    try:
        with structlog.testing.capture_logs() as lines:
            assert httpx.post(url, json=SMALL, timeout=10).status_code == 401
            with futures.ThreadPoolExecutor(1) as pool:
                first = pool.submit(httpx.post, url, json=SMALL, headers=token, timeout=30)
                assert slow.entered.wait(10)
                assert httpx.post(url, json=SMALL, headers=token, timeout=10).status_code == 503
                slow.release.set()
                first.result()
    finally:
        slow.release.set()
        server.wait_stopped()
    assert _count("UNAUTHENTICATED") == before["UNAUTHENTICATED"] + 1
    assert _count("RESOURCE_EXHAUSTED") == before["RESOURCE_EXHAUSTED"] + 1
    decided = {(x["status"], x["http_status"], x.get("outcome")) for x in lines if x["event"] == "decide"}
    assert decided >= {("UNAUTHENTICATED", 401, "UNAUTHENTICATED"), ("RESOURCE_EXHAUSTED", 503, "RESOURCE_EXHAUSTED")}
