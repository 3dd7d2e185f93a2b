"""Ports bound exclusively, public reflection limited to the public API, one-line flag errors,
limits compared at connect, and outcome metrics that match what clients saw."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from other_export import other_export

from openjev import interceptors, logs
from openjev.client import Client
from openjev.tools import launch


def _run(module: str, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_second_server_on_a_busy_port_exits_with_one_line(pair, demo_model):
    """Before, a second worker on a busy port logged `serving` and took half the connections."""
    for program, module, address, extra in (
        ("openjev-frontend", launch.FRONTEND_MODULE, pair.frontend.address, ["--worker", pair.worker.address]),
        ("openjev-worker", launch.WORKER_MODULE, pair.worker.address, []),
    ):
        done = _run(module, ["--model", str(demo_model), "--listen", address, "--plaintext", *extra])
        assert done.returncode == 1, done.stderr
        last = done.stderr.strip().splitlines()[-1]  # earlier lines: the JSON config log
        assert last == f"{program}: cannot listen on {address}: the address is in use or not available"
        assert "Traceback" not in done.stderr and '"serving"' not in done.stderr


def test_a_busy_metrics_port_exits_with_one_line(demo_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for program, module, extra in (
            ("openjev-worker", launch.WORKER_MODULE, []),
            ("openjev-frontend", launch.FRONTEND_MODULE, ["--worker", "127.0.0.1:1"]),
        ):
            listen = f"127.0.0.1:{launch.free_port()}"
            done = _run(
                module,
                ["--model", str(demo_model), "--listen", listen, "--plaintext", "--metrics-port", str(port), *extra],
            )
            assert done.returncode == 1, done.stderr
            last = done.stderr.strip().splitlines()[-1]
            assert last.startswith(f"{program}: cannot listen on 127.0.0.1:{port} for metrics: "), done.stderr
            assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("module", "args", "env", "names"),
    [
        (launch.FRONTEND_MODULE, ["--max-questions", "0"], {}, "--max-questions"),
        (launch.FRONTEND_MODULE, ["--worker-refresh-seconds", "0"], {}, "--worker-refresh-seconds"),
        (launch.FRONTEND_MODULE, ["--max-candidates", "65537"], {}, "--max-candidates"),
        (launch.WORKER_MODULE, ["--grace-seconds", "-1"], {}, "--grace-seconds"),
        (launch.WORKER_MODULE, ["--max-launch-tokens", "0"], {}, "--max-launch-tokens"),
        (launch.WORKER_MODULE, [], {"OPENJEV_QUEUE_CAPACITY": "many"}, "OPENJEV_QUEUE_CAPACITY"),
        (launch.WORKER_MODULE, [], {"OPENJEV_BACKEND": "gpu"}, "OPENJEV_BACKEND"),
        (launch.WORKER_MODULE, ["--log-level", "verbose"], {}, "--log-level"),
        (launch.FRONTEND_MODULE, [], {"OPENJEV_LOG_LEVEL": "loud"}, "OPENJEV_LOG_LEVEL"),
        (launch.WORKER_MODULE, ["--synthetic", "small"], {}, "--synthetic"),
        (launch.WORKER_MODULE, ["--chunk-tokens", "100"], {}, "--chunk-tokens"),  # its vocabulary is too small
        # a chunk over the pass budget (refused after the weights had loaded, with exit status 1)
        (launch.WORKER_MODULE, ["--chunk-tokens", "8192"], {}, "--chunk-tokens 8192 exceeds --max-launch-tokens 4096"),
        (launch.WORKER_MODULE, ["--max-launch-tokens", "32"], {}, "--max-launch-tokens 32 is below 64"),
        (
            launch.WORKER_MODULE,
            ["--shared-launch-tokens", "8192"],
            {},
            "--shared-launch-tokens 8192 exceeds --max-launch-tokens 4096",
        ),
        (
            launch.WORKER_MODULE,
            ["--shared-launch-tokens", "1024", "--chunk-tokens", "2048"],
            {},
            "--chunk-tokens 2048 exceeds --shared-launch-tokens 1024",
        ),
        (
            launch.WORKER_MODULE,
            ["--max-request-tokens", "100", "--max-held-tokens", "99"],
            {},
            "--max-held-tokens 99 is below --max-request-tokens 100",
        ),
        (
            launch.WORKER_MODULE,
            ["--backend", "cuda", "--gdn-kernel", "chunked", "--max-launch-sequences", "1024"],
            {},
            "--max-launch-sequences 1024 exceeds 1023",
        ),
        (launch.FRONTEND_MODULE, ["--http-max-body-bytes", "-5"], {}, "--http-max-body-bytes"),
    ],
)
def test_bad_flags_are_one_line_errors(demo_model, module, args, env, names):
    done = _run(module, ["--model", str(demo_model), *args], env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and names in lines[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_the_chunked_kernels_segment_limit_is_the_cuda_backends_alone(demo_model, tmp_path):
    """--gdn-kernel is a cuda backend flag: a torch worker given a pass of more sequences than the
    chunked kernel plans serves (it exited 2, while a budget cuda cannot launch otherwise passed)."""
    args = ["--model", str(demo_model), "--backend", "torch", "--plaintext", "--gdn-kernel", "chunked"]
    worker = launch.start("worker", launch.WORKER_MODULE, [*args, "--max-launch-sequences", "2000"], workdir=tmp_path)
    try:
        assert worker.popen.poll() is None, worker.log_text()
    finally:
        worker.stop()


def test_an_empty_environment_variable_is_unset(demo_model, tmp_path):
    """Blanking an inherited OPENJEV_* value (an image's ENV) gives the flag's default: here no TLS
    files, so --plaintext serves, rather than a certificate path of '.'."""
    port_file = tmp_path / "port"
    env = {"OPENJEV_TLS_CERT": "", "OPENJEV_TLS_KEY": "", "OPENJEV_LOG_LEVEL": ""}
    args = ["--model", str(demo_model), "--listen", "127.0.0.1:0", "--plaintext", "--port-file", str(port_file)]
    server = subprocess.Popen(
        [sys.executable, "-m", launch.WORKER_MODULE, *args],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.poll() is None and port_file.exists(), server.stderr.read() if server.stderr else ""
    finally:
        server.terminate()
        server.wait(30)


def _symbol(address: str, symbol: str):
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        return list(stub.ServerReflectionInfo(iter([request]), timeout=10))[0]


def test_public_reflection_does_not_describe_the_worker_schema(pair):
    assert _symbol(pair.frontend.address, "openjev.v1.DecisionService").HasField("file_descriptor_response")
    hidden = _symbol(pair.frontend.address, "openjev.worker.v1.WorkerService")
    assert hidden.HasField("error_response") and not hidden.HasField("file_descriptor_response")
    assert _symbol(pair.worker.address, "openjev.worker.v1.WorkerService").HasField("file_descriptor_response")


@pytest.mark.parametrize(
    ("other_model", "worker_args", "reason"),
    [
        (
            False,
            ["--max-questions", "10"],
            "accepts at most 10 questions per request, fewer than this frontend's --max-questions 4096",
        ),
        (
            False,
            ["--max-request-tokens", "1000"],
            "accepts at most 1000 tokens per request, fewer than this frontend's --max-request-tokens",
        ),
        # the same tokenizer and limits, another model: its answers would go out under this one's name
        (True, [], "serves model 'open-jev-other', not this frontend's 'open-jev-demo'"),
    ],
)
def test_frontend_refuses_a_worker_with_smaller_limits_or_another_model(
    demo_model, tmp_path, other_model, worker_args, reason
):
    model = (
        other_export(demo_model, tmp_path / "other", model_id="open-jev-other", temperature=1.0)
        if other_model
        else demo_model
    )
    worker = launch.start_worker(model, tmp_path, worker_args)
    http_port = launch.free_port()
    frontend = launch.start_frontend(
        demo_model,
        worker.address,
        tmp_path,
        ["--worker-refresh-seconds", "0.5", "--http-listen", f"127.0.0.1:{http_port}"],
    )
    body = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "i"}}}
    try:
        time.sleep(2.0)
        with Client(frontend.address) as client, pytest.raises(grpc.RpcError) as caught:
            client.decide(body, timeout=10)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"worker at {worker.address} {reason}" in caught.value.details()  # names the worker
        # over HTTP: no compatible worker, as /health says (not 502, "the worker failed")
        reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/systemone", json=body, timeout=10)
        assert (reply.status_code, reply.headers.get("retry-after")) == (503, "1"), reply.text
        assert f"worker at {worker.address} {reason}" in reply.json()["error"]
    finally:
        frontend.stop()
        worker.stop()


def test_a_worker_replaced_between_describes_never_answers_for_the_frontend(demo_model, tmp_path):
    """The frontend describes its worker every refresh period (here 600 s). A worker restarted on
    the same address with another model meanwhile gets no request answered in this frontend's
    name: calls fail (the old worker gone, or the new one refusing them) and the first refusal
    makes the frontend describe it at once, which refuses it for good."""
    port = launch.free_port()
    listen = ["--listen", f"127.0.0.1:{port}"]
    worker = launch.start_worker(demo_model, tmp_path, listen)
    frontend = launch.start_frontend(demo_model, worker.address, tmp_path, ["--worker-refresh-seconds", "600"])
    body = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "i"}}}
    try:
        with Client(frontend.address) as client:
            client.decide(body, timeout=30)
            worker.stop()
            worker = launch.start_worker(
                other_export(demo_model, tmp_path / "other", model_id="open-jev-other", temperature=1.0),
                tmp_path,
                listen,
                name="other",
            )
            deadline = time.monotonic() + 30
            while True:
                with pytest.raises(grpc.RpcError) as caught:  # never an answer
                    client.decide(body, timeout=30)
                if caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    break
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
                assert time.monotonic() < deadline, "the frontend did not describe the new worker"
                time.sleep(0.2)
            assert "serves model 'open-jev-other', not this frontend's 'open-jev-demo'" in caught.value.details()
    finally:
        frontend.stop()
        worker.stop()


def test_a_worker_that_comes_up_after_the_frontend_is_served_without_waiting_a_refresh(demo_model, tmp_path):
    """The link's state is computed at each refresh, and it is UNAVAILABLE while the traffic
    channel is not READY: a frontend that described its worker before that channel connected
    (at start, or before the worker was up) refused every call until the next refresh, 600 s
    here (a fresh-clone run failed on it, 2026-12-03). The channel's READY now refreshes at once."""
    port = launch.free_port()
    frontend = launch.start_frontend(demo_model, f"127.0.0.1:{port}", tmp_path, ["--worker-refresh-seconds", "600"])
    worker = None
    try:
        worker = launch.start_worker(demo_model, tmp_path, ["--listen", f"127.0.0.1:{port}"])
        launch.wait_serving(frontend.address, timeout_seconds=30)
        with Client(frontend.address) as client:
            assert client.decide({"state": "s", "questions": {"q": {"type": "noul", "instructions": "i"}}}, timeout=30)
    finally:
        frontend.stop()
        if worker is not None:
            worker.stop()


def test_a_worker_refuses_calls_that_expect_another_worker(demo_model, tmp_path):
    """What the frontend sends with every call: a worker that is not the one it describes refuses
    before accepting (no `openjev-accepted` header), so the call may go elsewhere."""
    from openjev import abi
    from openjev.export import load_export_meta
    from openjev.tokenizer import PromptTokenizer
    from openjev.worker.v1 import worker_pb2 as wire
    from openjev.worker.v1 import worker_pb2_grpc

    other = other_export(demo_model, tmp_path / "other", model_id="open-jev-other", temperature=1.0)
    worker = launch.start_worker(other, tmp_path)
    fingerprint = PromptTokenizer.from_export(demo_model).fingerprint
    request = wire.ExecuteUnaryRequest(
        header=wire.ExecuteHeader(questions=[wire.QuestionShape(kind=wire.QUESTION_KIND_NOUL, num_candidates=1)]),
        candidates=[wire.Candidate(token_ids=[1, 2, 3])],
    )

    def expecting(model) -> list[tuple[str, str]]:
        meta = load_export_meta(model)
        return [
            (
                abi.EXPECT_METADATA_KEY,
                abi.expected_worker(fingerprint, meta.max_length, meta.model_id, meta.temperature),
            )
        ]

    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.ExecuteUnary(request, metadata=expecting(demo_model), timeout=30)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "this worker is not the one the frontend described" in caught.value.details()
            assert abi.ACCEPTED_METADATA_KEY not in dict(caught.value.initial_metadata())
            assert len(stub.ExecuteUnary(request, metadata=expecting(other), timeout=30).questions) == 1
    finally:
        worker.stop()


class _Recorder(interceptors.Observer):
    def __init__(self):
        self.outcomes: list[str] = []
        self.ended = threading.Event()

    def on_end(self, info, outcome, seconds):
        self.outcomes.append(outcome)
        self.ended.set()


@pytest.mark.parametrize("ends", ["abort", "answer"])
def test_outcomes_tell_client_deadline_and_cancel_apart_from_server_errors(ends):
    """A real server with the real interceptor; the handler notices its caller left and ends
    the way the servicers do (abort CANCELLED), or returns its answer all the same (one computed
    as the caller left): no one got it, so it is not counted OK."""
    recorder = _Recorder()

    def slow(request, context):
        while context.is_active():
            time.sleep(0.01)
        if ends == "abort":
            context.abort(grpc.StatusCode.CANCELLED, "client went away")
        return b"too late"

    method = "/t.T/Slow"
    handler = grpc.method_handlers_generic_handler(
        "t.T", {"Slow": grpc.unary_unary_rpc_method_handler(slow, lambda b: b, lambda b: b)}
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(4),
        interceptors=[interceptors.RequestInterceptor({method: recorder}, make_ids=True)],
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(method, lambda b: b, lambda b: b)
            with pytest.raises(grpc.RpcError):
                call(b"x", timeout=0.3)
            assert recorder.ended.wait(5)
            recorder.ended.clear()
            future = call.future(b"x", timeout=30)
            time.sleep(0.3)
            future.cancel()
            assert recorder.ended.wait(5)
    finally:
        server.stop(0)
    assert recorder.outcomes == ["DEADLINE_EXCEEDED", "CLIENT_CANCELLED"]


def test_tokens_are_counted_for_answered_calls_only():
    """The frontend's token series count what callers got: an answer its caller left before it
    was sent is counted under its outcome's latency series, and not in the tokens."""
    from openjev import metrics
    from openjev.v1 import decision_pb2 as api

    def tokens() -> float:
        return metrics.frontend_registry.get_sample_value("openjev_frontend_input_tokens_total") or 0.0

    observer = metrics.FrontendObserver()
    for outcome, counted in (("CLIENT_CANCELLED", 0), ("OK", 7)):
        info = interceptors.RequestInfo("/m", "r")
        before = tokens()
        observer.on_start(info)
        observer.on_response(info, api.DecideResponse(usage=api.Usage(input_tokens=7)))
        observer.on_end(info, outcome, 0.01)
        assert tokens() - before == counted, outcome


def test_a_caller_deadline_seen_as_a_cancel_is_still_its_deadline():
    """The caller's timer fires before the server's copy of its deadline: the call ends cancelled
    with a few ms still remaining on the server, and is the caller's deadline all the same."""
    info = interceptors.RequestInfo("/m", "r")
    assert interceptors.ended_outcome("CANCELLED", info, 0.007, active=False) == "DEADLINE_EXCEEDED"
    assert interceptors.ended_outcome("CANCELLED", info, 5.0, active=False) == "CLIENT_CANCELLED"
    assert interceptors.ended_outcome("UNAVAILABLE", info, 0.05, active=True) == "UNAVAILABLE"
    assert interceptors.ended_outcome("CANCELLED", info, None, active=False) == "CLIENT_CANCELLED"


def test_client_deadlines_through_the_servers_are_counted_and_logged_as_deadlines(demo_model, tmp_path):
    """Decide calls whose own 1 s deadline passes while the worker computes: the frontend counts
    and logs each as DEADLINE_EXCEEDED (4 of 6 were CLIENT_CANCELLED, every log line CANCELLED), and
    so does the worker's `execute` line, as its metrics did (it said CANCELLED, no outcome: a review
    helper's finding)."""
    from openjev.tools.soak import log_events, outcome_counts

    metrics_port = launch.free_port()
    pair = launch.start_pair(demo_model, tmp_path, frontend_args=["--metrics-port", str(metrics_port)])
    criteria = {f"c{j}": f"candidate {j}" for j in range(100)}
    big = {
        "state": "A long state. " * 50,
        "questions": {f"q{i}": {"type": "choice", "instructions": f"Pick {i}", "criteria": criteria} for i in range(2)},
    }
    try:
        with Client(pair.frontend.address) as client:
            for n in range(4):
                with pytest.raises(grpc.RpcError) as caught:
                    client.decide(big, policy="off", timeout=1.0, request_id=f"late-{n}")
                assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        deadline = time.monotonic() + 10
        while sum(outcome_counts(url, "openjev_frontend_request_seconds_count").values()) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert outcome_counts(url, "openjev_frontend_request_seconds_count") == {"DEADLINE_EXCEEDED": 4.0}
        statuses = [(e["status"], e["outcome"]) for e in log_events(pair.frontend.log_text(), "decide")]
        assert statuses == [("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED")] * 4
        while len(log_events(pair.worker.log_text(), "execute")) < 4:  # each ends at its next pass
            assert time.monotonic() < deadline + 20
            time.sleep(0.1)
        worker = [(e["status"], e["outcome"]) for e in log_events(pair.worker.log_text(), "execute")]
        assert worker == [("DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED")] * 4, worker
    finally:
        pair.stop()


UPGRADE = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"
JUNK = b"\x00junk\r\n\r\n"


def _http_frontend(demo_model, tmp_path) -> tuple[launch.Process, int]:
    http_port = launch.free_port()
    frontend = launch.start_frontend(
        demo_model, f"127.0.0.1:{launch.free_port()}", tmp_path, ["--http-listen", f"127.0.0.1:{http_port}"]
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", http_port), timeout=5).close()
            return frontend, http_port
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def _send(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(data)
        return connection.recv(4096)


def _records(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def test_library_log_lines_are_json_too(demo_model, tmp_path):
    """Records of libraries that log through the standard library (uvicorn here, on a websocket
    upgrade sent to the HTTP port) are JSON objects with event, level and logger like ours (they
    were plain text)."""
    frontend, http_port = _http_frontend(demo_model, tmp_path)
    try:
        assert _send(http_port, UPGRADE).startswith(b"HTTP/1.1 ")  # no worker: 503
        deadline = time.monotonic() + 10
        while "Unsupported upgrade request" not in frontend.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        frontend.stop()
    library = [r for r in _records(frontend.log_text()) if r.get("event") == "Unsupported upgrade request."]
    assert library and library[0]["level"] == "warning" and library[0]["logger"] == "uvicorn.error"


def test_lines_any_client_can_cause_are_throttled_and_counted(demo_model, tmp_path):
    """Junk and websocket upgrades sent as fast as a client can: each kind of line is logged at
    most once a second, and the next one logged counts those dropped (`dropped`), so that a client
    cannot fill the log and nothing goes uncounted (one line each, uvicorn's without a peer,
    before 2026-12-05). Junk is logged as `http_malformed` with the peer and the request id of
    the 400 it got."""
    frontend, http_port = _http_frontend(demo_model, tmp_path)
    sent = 80
    try:
        began = time.monotonic()
        ids = set()
        for _ in range(sent - 1):
            ids.add(_send(http_port, JUNK).split(b"x-request-id: ")[1][:32].decode())
            _send(http_port, UPGRADE)
        burst = time.monotonic() - began
        time.sleep(1.2)  # the next of each kind is logged, with the count of the burst's dropped
        ids.add(_send(http_port, JUNK).split(b"x-request-id: ")[1][:32].decode())
        _send(http_port, UPGRADE)

        def counted(event: str) -> list[dict]:
            return [r for r in _records(frontend.log_text()) if r.get("event") == event]

        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline
            and sum(1 + r.get("dropped", 0) for r in counted("Unsupported upgrade request.")) < sent
        ):
            time.sleep(0.1)
    finally:
        frontend.stop()
    malformed, upgrades = counted("http_malformed"), counted("Unsupported upgrade request.")
    most = burst + 3  # a line a second at most, the one after the pause among them
    assert sum(1 + r["dropped"] for r in malformed) == sent and len(malformed) <= most, malformed
    assert sum(1 + r.get("dropped", 0) for r in upgrades) == sent and len(upgrades) <= most, upgrades
    assert all(r["peer"].startswith("127.0.0.1:") and r["request_id"] in ids for r in malformed)
    assert malformed[-1]["dropped"] > 0 and upgrades[-1]["dropped"] > 0
    assert "Invalid HTTP request received." not in frontend.log_text()  # replaced by http_malformed


def test_library_errors_pass_the_throttle():
    """Only warnings are throttled: an error in uvicorn (an exception in the app) may be another
    bug each time, with its own traceback (a review, 2026-12-05: the second of two in a second
    was dropped)."""
    lines = logs.ThrottledLines(replaced=frozenset({"replaced"}))

    def passes(level: int, message: str) -> bool:
        return lines.filter(logging.LogRecord("uvicorn.error", level, __file__, 1, message, None, None))

    assert [passes(logging.WARNING, "Unsupported upgrade request.") for _ in range(3)] == [True, False, False]
    assert [passes(logging.ERROR, "Exception in ASGI application\n") for _ in range(3)] == [True] * 3
    assert not passes(logging.WARNING, "replaced")


def _config_and_events(log: str) -> tuple[dict, set[str]]:
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    config = next(line for line in lines if line.get("event") == "config")
    return config, {line.get("event") for line in lines}


def test_the_chunk_defaults_to_half_the_pass_budget(demo_model, tmp_path):
    """A worker given a 512-token pass budget chunks long prompts at 256 tokens (the chunk was
    2,048 whatever the budget, so it refused to start); a chunk that fills the pass is logged, as
    it leaves short requests no room beside a long prompt."""
    worker = launch.start_worker(demo_model, tmp_path, ["--max-launch-tokens", "512"], name="half")
    try:
        config, events = _config_and_events(worker.log_text())
        assert config["chunk_tokens"] == 256 and "chunk_fills_pass" not in events
    finally:
        worker.stop()
    full = ["--max-launch-tokens", "512", "--chunk-tokens", "512"]
    worker = launch.start_worker(demo_model, tmp_path, full, name="full")
    try:
        config, events = _config_and_events(worker.log_text())
        assert config["chunk_tokens"] == 512 and "chunk_fills_pass" in events
    finally:
        worker.stop()
    # a shorter shared pass: the chunk defaults to half of it
    worker = launch.start_worker(demo_model, tmp_path, ["--shared-launch-tokens", "1024"], name="shared")
    try:
        config, events = _config_and_events(worker.log_text())
        assert config["chunk_tokens"] == 512 and config["shared_launch_tokens"] == 1024
        assert "chunk_fills_pass" not in events
    finally:
        worker.stop()


@pytest.mark.parametrize("args", [["127.0.0.1:1", "--timeout", "-1"], ["127.0.0.1:1", "--timeout", "nan"], ["noport"]])
def test_the_health_check_refuses_bad_flags(args):
    """A negative or NaN timeout answered DEADLINE_EXCEEDED and an address without a port
    UNAVAILABLE, as if the server were at fault: a probe misconfigured must say so."""
    done = subprocess.run(
        [sys.executable, "-m", "openjev.healthcheck", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "python -m openjev.healthcheck: error:" in done.stderr, done.stderr


def test_a_model_path_that_is_a_file_says_so(tmp_path):
    from openjev.export import ExportError, load_export_meta

    (tmp_path / "model").write_text("{}")
    with pytest.raises(ExportError, match="model: is a file, not an export directory"):
        load_export_meta(tmp_path / "model")
