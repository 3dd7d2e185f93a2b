"""The client library's and command line's edges: an answer from a newer server, a terminal that
is not UTF-8, a closed pipe or stdin, and arguments the servers would refuse as something else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest

from openjev.client import Client, response_to_json
from openjev.tools import launch
from openjev.v1 import decision_pb2 as api
from openjev.v1 import decision_pb2_grpc

REQUEST = {"state": "café", "questions": {"ré😀": {"type": "noul", "instructions": "ok?"}}}


def test_an_enum_value_of_a_newer_server_is_named_not_a_crash():
    response = api.DecideResponse()
    response.metadata.prefix_cache.policy = 7
    response.metadata.prefix_cache.scope = 9
    cache = response_to_json(response)["metadata"]["prefix_cache"]
    assert cache["policy"] == "unknown-7" and cache["scope"] == "unknown-9"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"timeout": float("nan")}, "timeout must be a positive number"),
        ({"request_id": "a b"}, "request_id must be"),
        ({"request_id": "é"}, "request_id must be"),
        ({"request_id": "x" * 129}, "request_id must be"),
    ],
)
def test_arguments_the_servers_would_refuse_as_something_else(kwargs, message):
    with Client("127.0.0.1:1") as client, pytest.raises(ValueError, match=message):
        client.decide(REQUEST, **kwargs)


def _cli(*args: str, env: dict | None = None, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "openjev.tools.cli", *args],
        capture_output=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        stdin=stdin,
    )


def test_cli_writes_utf8_whatever_the_terminal(pair, tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(REQUEST), encoding="utf-8")
    out = _cli("decide", str(path), "--addr", pair.frontend.address, env={"PYTHONIOENCODING": "latin-1"})
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout.decode("utf-8"))["answers"]["ré😀"]["type"] == "noul"


def test_cli_with_stdin_closed_says_so(pair):
    out = _cli("decide", "-", "--addr", pair.frontend.address, stdin=subprocess.DEVNULL)
    assert out.returncode != 0  # an empty body: the contract's error, one line
    assert b"Traceback" not in out.stderr
    closed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.stdin.close(); sys.stdin = None; "
            "from openjev.tools.cli import main; main(['decide', '-', '--addr', '127.0.0.1:1'])",
        ],
        capture_output=True,
        timeout=60,
    )
    assert closed.returncode == 1 and closed.stderr.strip().endswith(b"no standard input to read the request from")


def test_cli_into_a_closed_pipe_exits_quietly(pair, tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(REQUEST), encoding="utf-8")
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the answer is written (`| head -c 0`)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "openjev.tools.cli", "decide", str(path), "--addr", pair.frontend.address],
            stdout=write,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.returncode == 141 and b"Traceback" not in done.stderr, done.stderr.decode()


def test_cli_into_an_output_it_cannot_write_says_so_in_one_line(pair, tmp_path):
    """A full disk (/dev/full) or a closed stdout ended in a traceback (the computed answer lost
    either way); now one error line and exit 1."""
    path = tmp_path / "request.json"
    path.write_text(json.dumps(REQUEST), encoding="utf-8")
    command = [sys.executable, "-m", "openjev.tools.cli", "decide", str(path), "--addr", pair.frontend.address]
    with open("/dev/full", "wb") as full:
        done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, timeout=120)
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 1 and lines == ["error: cannot write the output: No space left on device"], lines
    closed = subprocess.run(["sh", "-c", '"$@" >&-', "sh", *command], stderr=subprocess.PIPE, timeout=120)
    lines = closed.stderr.decode().strip().splitlines()
    assert closed.returncode == 1 and lines == ["error: cannot write the output: standard output is closed"], lines


def test_an_answer_of_a_kind_this_build_does_not_know_keeps_the_others():
    """A kind a newer server added to the answer (a change buf allows) raised ValueError, losing
    every answer of the response, and `openjev decide` printed a traceback."""
    response = api.DecideResponse()
    known = response.answers.add(question_id="q1", keys=["yes", "no"], probabilities=[0.25, 0.75])
    known.noul.noul = 0.25
    newer = response.answers.add(question_id="q2", keys=["a", "b"], probabilities=[0.5, 0.5])
    parsed = api.DecideResponse.FromString(response.SerializeToString())
    with pytest.raises(ValueError, match="has no kind"):  # the frontend's own (HTTP) answers always have one
        response_to_json(parsed)
    answers = response_to_json(parsed, newer_kinds=True)["answers"]
    assert answers["q1"] == {"type": "noul", "noul": 0.25}
    assert answers["q2"] == {"type": "unknown", "probabilities": {"a": 0.5, "b": 0.5}}
    assert newer.WhichOneof("kind") is None


def test_an_unknown_policy_is_a_value_error():
    """`policy="bogus"` (or "AUTO") raised a bare KeyError from the enum table."""
    with Client("127.0.0.1:1") as client:
        for policy in ("bogus", "AUTO"):
            with pytest.raises(ValueError, match="policy must be one of off, default, shared, fixed, auto"):
                client.decide(REQUEST, policy=policy)  # type: ignore[arg-type]


class _Answering(decision_pb2_grpc.DecisionServiceServicer):
    def Decide(self, request, context):
        return api.DecideResponse(model="m")


def _serve(port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    decision_pb2_grpc.add_DecisionServiceServicer_to_server(_Answering(), server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    return server


def test_a_persistent_client_reaches_a_restarted_frontend_within_seconds():
    """gRPC's reconnect backoff grows to 120 s, and calls meanwhile fail UNAVAILABLE at once: a
    Client kept refused 40 s after a 75 s restart. After 20 s down (the default backoff's next try
    then ~6 s away) it answers within 3 s of the frontend's return."""
    port = launch.free_port()
    server = _serve(port)
    with Client(f"127.0.0.1:{port}") as client:
        assert client.decide(REQUEST, timeout=10)["model"] == "m"
        server.stop(0).wait()
        down_until = time.monotonic() + 20
        while time.monotonic() < down_until:  # calls fail while it is down, as the backoff grows
            with pytest.raises(grpc.RpcError):
                client.decide(REQUEST, timeout=5)
            time.sleep(0.5)
        server = _serve(port)
        back = time.monotonic()
        try:
            while True:
                try:
                    assert client.decide(REQUEST, timeout=5)["model"] == "m"
                    break
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() - back < 3.0, "still refused 3 s after the frontend came back"
                    time.sleep(0.1)
        finally:
            server.stop(0).wait()


def test_a_call_without_a_deadline_to_a_frontend_that_stopped_answering_ends(demo_model, pair, tmp_path):
    """The channel had no keepalive: a call without a deadline to a frontend that stopped answering
    (a frozen host: SIGSTOP here) waited for good. Pings end it UNAVAILABLE within ~15 s."""
    frontend = launch.start_frontend(demo_model, pair.worker.address, tmp_path)
    try:
        with Client(frontend.address) as client:
            assert client.decide(REQUEST, timeout=30)["answers"]
            pool = futures.ThreadPoolExecutor(1)
            frontend.popen.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            try:
                call = pool.submit(client.decide, REQUEST)  # no deadline
                with pytest.raises(grpc.RpcError) as ended:
                    call.result(timeout=40)
            finally:  # resumed first: a call still waiting then ends, and so does the pool
                frontend.popen.send_signal(signal.SIGCONT)
                pool.shutdown(wait=True)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 30
    finally:
        frontend.stop()
