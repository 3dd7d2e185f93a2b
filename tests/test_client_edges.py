"""The client library's and command line's edges: an answer from a newer server, a terminal that
is not UTF-8, a closed pipe or stdin, and arguments the servers would refuse as something else."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from openjev.client import Client, response_to_json
from openjev.v1 import decision_pb2 as api

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
