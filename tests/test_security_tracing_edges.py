"""What a mutation review of common/security.py and common/tracing.py found no test pinning: the
TLS files given by halves or unusable, token lists with blanks and separators, the bearer check
of every call shape behind a real gRPC server on loopback, and the server spans' outcomes
(streams the caller closed, handlers that raised, the codes and HTTP statuses that are the
server's failures). Certificates from tests/test_security.py's `pki`; spans in memory."""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from test_security import pki  # noqa: F401  (a fixture: a CA, another one, a server and a client leaf of each)

from openjev import security, tracing
from openjev.tools import launch
from openjev.tools.soak import log_events

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra")
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from test_tracing import collector  # noqa: E402, F401  (a fixture: an OTLP receiver on loopback)

TOKEN = "tok-one-aaaaaaaaaaaa"
SERVICE = "test.Echo"
CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


# ---------------------------------------------------------------- TLS files


def test_server_tls_files_given_by_halves_or_unusable_are_refused(pki, tmp_path):  # noqa: F811
    """A client CA without a certificate would have served plaintext, a CA file that is no CA
    would have failed only when the port was bound, a blank file would have been taken."""
    cert, key = pki["ca-server"], pki["ca-server-key"]
    with pytest.raises(security.SecurityError, match="^--tls-client-ca needs --tls-cert and --tls-key$"):
        security.server_credentials(None, None, pki["ca"])
    for half in ((cert, None), (None, key)):
        with pytest.raises(security.SecurityError, match="^--tls-cert and --tls-key go together$"):
            security.server_credentials(*half, None)
    with pytest.raises(security.SecurityError, match="^--tls-client-ca .*: not a PEM CA certificate"):
        security.server_credentials(cert, key, pki["ca-client-key"])
    broken = tmp_path / "broken.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(security.SecurityError) as refused:  # OpenSSL gives no reason for this one
        security.server_credentials(broken, key, None)
    assert str(refused.value).endswith("not a PEM certificate and its unencrypted private key (unreadable)")
    blank = tmp_path / "blank.pem"
    blank.write_text(" \n\t\n")
    with pytest.raises(security.SecurityError, match=r"^--tls-client-ca .*: not a PEM CA certificate \(unreadable\)$"):
        security.server_credentials(cert, key, broken)  # OpenSSL gives no reason here either
    with pytest.raises(security.SecurityError, match=f"^client CA {blank} is empty$"):
        security.server_credentials(cert, key, blank)
    assert isinstance(security.server_credentials(cert, key, pki["ca"]), grpc.ServerCredentials)
    assert security.server_credentials(None, None, None) is None


def test_worker_channel_tls_files_given_by_halves_are_refused(pki):  # noqa: F811
    """A client certificate without the CA (the link would be plaintext, the certificate
    ignored) or without its key is refused, as --worker-tls-server-name without the CA is."""
    ca, cert, key = pki["ca"], pki["ca-client"], pki["ca-client-key"]
    for half in ((cert, key), (cert, None), (None, key)):
        with pytest.raises(security.SecurityError, match="need --worker-tls-ca$"):
            security.channel_credentials(None, *half)
    for half in ((cert, None), (None, key)):
        with pytest.raises(security.SecurityError, match="^--worker-tls-cert and --worker-tls-key go together$"):
            security.channel_credentials(ca, *half)
    assert isinstance(security.channel_credentials(ca, None, None), grpc.ChannelCredentials)


# ---------------------------------------------------------------- token lists


def test_token_variable_blanks_and_separators_are_not_tokens():
    """`OPENJEV_AUTH_TOKENS="a, b"` is two tokens without their spaces; an empty item between
    commas is no token (an empty token would match "Bearer " plus blanks); `~` is printable."""
    given = {security.AUTH_TOKENS_ENV: " tok-one-aaaaaaaaaaaa ,\ttok~two-bbbbbbbbbbb,, "}
    assert security.load_tokens(None, given) == (b"tok-one-aaaaaaaaaaaa", b"tok~two-bbbbbbbbbbb")


@pytest.mark.parametrize("stray", ["\x0c", "\x1c", "\x85", "\xa0"])
def test_a_control_character_at_a_tokens_end_refuses_it_rather_than_being_dropped(tmp_path, stray):
    """Only spaces, tabs and a CR surround a token; any other character there is the token's,
    refused as a presented token with it would be (str.strip() took it off: a token the
    operator never wrote)."""
    token_file = tmp_path / "tokens"
    token_file.write_text(f"LongSecretPart1{stray}\n", encoding="utf-8")
    with pytest.raises(security.SecurityError, match="token 1 has characters other than printable ASCII"):
        security.load_tokens(token_file, environ={})
    with pytest.raises(security.SecurityError, match="token 1 has characters other than printable ASCII"):
        security.load_tokens(None, environ={security.AUTH_TOKENS_ENV: f"{stray}LongSecretPart1"})


def test_a_bad_token_is_numbered_within_its_own_source(tmp_path):
    """The file's tokens come first; the variable's bad token is its own second one."""
    token_file = tmp_path / "tokens"
    token_file.write_text("file-token-one\nfile-token-two\n")
    given = {security.AUTH_TOKENS_ENV: "env-token-one,env-tok\u00e9n"}
    with pytest.raises(security.SecurityError, match=r"^\$OPENJEV_AUTH_TOKENS: token 2 has characters other than"):
        security.load_tokens(token_file, given)


def test_a_presented_token_must_be_whole_and_the_only_one():
    with pytest.raises(ValueError, match="at least one token"):
        security.BearerAuth(())
    auth = security.BearerAuth((TOKEN.encode(), b"second-token-bbbbbbbb"))
    assert auth.allowed(f"Bearer {TOKEN}") and auth.allowed("Bearer second-token-bbbbbbbb")
    for header in (f"Bearer {TOKEN}-and-more", f"Bearer {TOKEN}x", "Bearer ", "Bearer  \t"):
        assert not auth.allowed(header), header
    assert auth.allowed_headers([f"Bearer {TOKEN}"])
    assert not auth.allowed_headers(["Bearer wrong", f"Bearer {TOKEN}"])
    assert not auth.allowed_headers([])


# ---------------------------------------------------------------- a real server on loopback


def _echo_handlers() -> dict[str, grpc.RpcMethodHandler]:
    """Each call shape, on bytes (no serializers): a unary request is used as bytes, so a handler
    given the wrong shape fails."""

    def unary_stream(request: bytes, context):
        for step in (b"1", b"2", b"3"):
            with tracing.span("step"):
                pass
            yield request + step

    def fail(request: bytes, context):
        raise ValueError("handler failed")

    return {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(lambda request, context: request + b"!"),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(lambda requests, context: b"".join(requests)),
        "StreamStream": grpc.stream_stream_rpc_method_handler(lambda requests, context: (r + b"!" for r in requests)),
        "Fail": grpc.unary_unary_rpc_method_handler(fail),
    }


@pytest.fixture
def echo_server(request):
    """A gRPC server on loopback with `request.param`'s interceptors; yields its channel."""
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=request.param())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, _echo_handlers()),))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    reflection.enable_server_reflection((SERVICE, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        server.stop(0)


def _shapes(channel: grpc.Channel) -> dict:
    """Each call shape: a function of the call's metadata that returns its answer, read whole."""
    return {
        "UnaryUnary": lambda md: channel.unary_unary(f"/{SERVICE}/UnaryUnary")(b"a", metadata=md, timeout=10),
        "UnaryStream": lambda md: list(channel.unary_stream(f"/{SERVICE}/UnaryStream")(b"a", metadata=md, timeout=10)),
        "StreamUnary": lambda md: channel.stream_unary(f"/{SERVICE}/StreamUnary")(
            iter([b"a", b"b"]), metadata=md, timeout=10
        ),
        "StreamStream": lambda md: list(
            channel.stream_stream(f"/{SERVICE}/StreamStream")(iter([b"a", b"b"]), metadata=md, timeout=10)
        ),
    }


@pytest.mark.parametrize(
    "echo_server", [lambda: [security.BearerAuth((TOKEN.encode(),))]], indirect=True, ids=["bearer"]
)
def test_every_call_shape_is_refused_without_the_token(echo_server):
    """The public API has unary methods only; the interceptor refuses the streaming shapes too,
    each with its request id; health and reflection stay open; a method nobody serves stays
    UNIMPLEMENTED."""
    shapes = _shapes(echo_server)
    answers = {shape: call([("authorization", f"Bearer {TOKEN}")]) for shape, call in shapes.items()}
    assert answers == {
        "UnaryUnary": b"a!",
        "UnaryStream": [b"a1", b"a2", b"a3"],
        "StreamUnary": b"ab",
        "StreamStream": [b"a!", b"b!"],
    }
    for shape, call in shapes.items():
        for metadata in ([], [("authorization", "Bearer wrong")], [("x-request-id", f"shape-{shape}")]):
            with pytest.raises(grpc.RpcError) as caught:
                call(metadata)
            refusal = (caught.value.code(), caught.value.details())
            assert refusal == (grpc.StatusCode.UNAUTHENTICATED, security.UNAUTHENTICATED_MESSAGE), (shape, metadata)
            request_id = dict(caught.value.trailing_metadata() or ()).get("x-request-id")
            assert request_id == dict(metadata).get("x-request-id", request_id) and request_id, (shape, metadata)
    probe = health_pb2_grpc.HealthStub(echo_server).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert probe.status == health_pb2.HealthCheckResponse.SERVING
    listing = reflection_pb2.ServerReflectionRequest(list_services="")
    [listed] = reflection_pb2_grpc.ServerReflectionStub(echo_server).ServerReflectionInfo(iter([listing]), timeout=10)
    assert SERVICE in {service.name for service in listed.list_services_response.service}
    with pytest.raises(grpc.RpcError) as caught:
        echo_server.unary_unary(f"/{SERVICE}/Nowhere")(b"a", timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize(
    "echo_server", [lambda: [security.BearerAuth((TOKEN.encode(),))]], indirect=True, ids=["bearer"]
)
def test_a_stream_that_sends_nothing_yet_is_refused_at_once(echo_server):
    """A caller that opens a stream and waits for the server before it sends is refused at once
    (a refusal shaped as a unary request would wait for a first message, to its deadline)."""
    release = threading.Event()

    def nothing_yet():
        release.wait(30)
        yield b"late"

    try:
        for call in (
            lambda: echo_server.stream_unary(f"/{SERVICE}/StreamUnary")(nothing_yet(), timeout=20),
            lambda: list(echo_server.stream_stream(f"/{SERVICE}/StreamStream")(nothing_yet(), timeout=20)),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        release.set()


def test_a_token_shorter_than_16_characters_is_warned_of_at_start(demo_model, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("fifteen-chars-x\nsixteen-chars-xx\n")
    frontend = launch.start(
        "frontend-short-token",
        launch.FRONTEND_MODULE,
        ["--model", str(demo_model), "--worker", "127.0.0.1:1", "--plaintext", "--auth-token-file", str(tokens)],
        workdir=tmp_path,
    )
    try:  # logged before the port file is written
        [warning] = log_events(frontend.log_text(), "short_bearer_tokens")
    finally:
        frontend.stop()
    assert warning["count"] == 1 and "at least 16 random characters" in warning["hint"]


# ---------------------------------------------------------------- spans


@pytest.fixture
def spans():
    """Tracing on for this process, spans kept in memory (exported as each one ends)."""
    exporter = InMemorySpanExporter()
    assert tracing.configure("test", None, exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def _traced():
    return [tracing.ServerInterceptor({f"/{SERVICE}/UnaryStream", f"/{SERVICE}/StreamStream", f"/{SERVICE}/Fail"})]


def _by_name(exporter: InMemorySpanExporter) -> dict[str, list]:
    found: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


@pytest.mark.parametrize("echo_server", [_traced], indirect=True, ids=["traced"])
def test_server_spans_of_streams_continue_the_callers_trace_and_say_how_calls_ended(echo_server, spans):
    """A stream's server span is a SERVER child of the caller's span, the handler's own spans
    (made between its messages) are its children, and it ends with the stream; a handler that
    raised is UNKNOWN and ERROR."""
    metadata = [("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")]
    assert list(echo_server.unary_stream(f"/{SERVICE}/UnaryStream")(b"a", metadata=metadata, timeout=10)) == [
        b"a1",
        b"a2",
        b"a3",
    ]
    replies = echo_server.stream_stream(f"/{SERVICE}/StreamStream")(iter([b"x"]), metadata=metadata, timeout=10)
    assert list(replies) == [b"x!"]
    with pytest.raises(grpc.RpcError) as caught:
        echo_server.unary_unary(f"/{SERVICE}/Fail")(b"a", metadata=metadata, timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    found = _by_name(spans)
    for method in ("UnaryStream", "StreamStream", "Fail"):
        [server] = found[f"{SERVICE}/{method}"]
        assert server.kind == trace.SpanKind.SERVER, method
        assert (format(server.context.trace_id, "032x"), format(server.parent.span_id, "016x")) == (
            CALLER_TRACE,
            CALLER_SPAN,
        ), method
    stream = found[f"{SERVICE}/UnaryStream"][0]
    assert (stream.attributes["rpc.grpc.status_code"], stream.status.status_code.name) == (0, "UNSET")
    assert [s.parent.span_id for s in found["step"]] == [stream.context.span_id] * 3
    failed = found[f"{SERVICE}/Fail"][0]
    assert (failed.attributes["rpc.grpc.status_code"], failed.attributes["openjev.status"]) == (2, "UNKNOWN")
    assert failed.status.status_code.name == "ERROR"


class _Call:
    """What the server interceptor asks of a call's context: no status set, the caller gone,
    its deadline passed or not."""

    def __init__(self, remaining: float | None):
        self._remaining = remaining

    def code(self):
        return None

    def time_remaining(self):
        return self._remaining

    def is_active(self):
        return False


@pytest.mark.parametrize(
    ("remaining", "code", "status"), [(None, 1, "UNSET"), (0.0, 4, "ERROR")], ids=["cancel", "deadline"]
)
def test_a_stream_its_caller_closed_is_cancelled_or_its_deadline(spans, remaining, code, status):
    """A stream closed after its first message (the caller left): CANCELLED, no failure; closed
    with the caller's deadline passed: DEADLINE_EXCEEDED, as the call's log line has it."""
    method = f"/{SERVICE}/UnaryStream"
    details = type("Details", (), {"method": method, "invocation_metadata": ()})()
    handler = _echo_handlers()["UnaryStream"]
    wrapped = tracing.ServerInterceptor({method}).intercept_service(lambda _: handler, details)
    replies = wrapped.unary_stream(b"a", _Call(remaining))
    assert next(replies) == b"a1"
    replies.close()
    [server] = _by_name(spans)[method.lstrip("/")]
    assert (server.attributes["rpc.grpc.status_code"], server.status.status_code.name) == (code, status)


def test_what_a_started_span_is_given_is_recorded_and_it_is_exported_once(spans, caplog):
    """Attributes at the start and later, an exception event, a second end() that is no second
    end (the SDK warns of one), and the span exported when it ends, not at shutdown."""
    started = tracing.start("waited", queue_depth=3)
    started.set_attributes({"passes": 2, "policy": "default"})
    started.record_exception(ValueError("boom"))
    with caplog.at_level(logging.WARNING):
        started.end()
        started.end()
    assert [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")] == []
    [span] = spans.get_finished_spans()
    assert dict(span.attributes) == {"queue_depth": 3, "passes": 2, "policy": "default"}
    assert [event.name for event in span.events] == ["exception"]


def test_a_stream_abandoned_inside_a_span_with_refusals_is_no_failure(spans):
    """A generator closed inside the span (its caller left the stream) raises GeneratorExit
    there: not an error of the server's, as for a span without refusals."""

    def stream():
        with tracing.span("abandoned", refusals={LookupError: "NOT_FOUND"}):
            yield 1
            yield 2

    replies = stream()
    assert next(replies) == 1
    replies.close()
    [span] = spans.get_finished_spans()
    assert (span.status.status_code.name, list(span.events), dict(span.attributes)) == ("UNSET", [], {})


def test_shutdown_exports_what_is_buffered(collector):  # noqa: F811
    """Over OTLP spans are batched (every 5 s by default): shutdown, at a server's stop, sends
    them before it returns."""
    receiver, endpoint = collector
    assert tracing.configure("test-shutdown", endpoint)
    try:
        with tracing.span("buffered"):
            pass
    finally:
        tracing.shutdown()
    assert [(s["service"], s["name"]) for s in receiver.spans] == [("test-shutdown", "buffered")]


def test_a_server_span_is_a_server_span_continuing_the_callers_trace(spans):
    with tracing.server_span("POST /v1/x", {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}, a=1):
        pass
    [span] = spans.get_finished_spans()
    assert (span.kind, dict(span.attributes)) == (trace.SpanKind.SERVER, {"a": 1})
    assert format(span.parent.span_id, "016x") == CALLER_SPAN


@pytest.mark.parametrize(
    ("code", "http_status", "failed"),
    [
        ("OK", None, False),
        ("INVALID_ARGUMENT", None, False),
        ("RESOURCE_EXHAUSTED", None, False),
        ("CANCELLED", None, False),
        ("NOT_FOUND", None, False),
        ("UNKNOWN", None, True),
        ("UNIMPLEMENTED", None, True),
        ("DATA_LOSS", None, True),
        ("INTERNAL", None, True),
        ("UNAVAILABLE", None, True),
        ("INVALID_ARGUMENT", 499, False),
        ("INTERNAL", 500, True),
        ("UNAVAILABLE", 503, True),
    ],
)
def test_which_outcomes_are_the_servers_failures(spans, code, http_status, failed):
    with tracing.server_span("call", {}) as span:
        tracing.note_status(span, code, http_status)
    [ended] = spans.get_finished_spans()
    assert ended.status.status_code.name == ("ERROR" if failed else "UNSET")
    assert ended.attributes["openjev.status"] == code
    if http_status is None:
        assert ended.attributes["rpc.grpc.status_code"] == grpc.StatusCode[code].value[0]
    else:
        assert ended.attributes["http.response.status_code"] == http_status


def test_noting_an_outcome_while_tracing_is_off_does_nothing():
    """The HTTP route notes every request's status, 5xx included, whether or not tracing is on."""
    assert not tracing.enabled()
    with tracing.server_span("call", {}) as span:
        tracing.note_status(span, "INTERNAL", 500)
        tracing.note_status(span, "UNAVAILABLE")
    tracing.note_outcome(tracing.start("inner"), "INTERNAL")
