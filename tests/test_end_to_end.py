"""Both servers as subprocesses on loopback: answers, ABI safety, worker loss, the CLI."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from openjev import abi
from openjev.client import Client
from openjev.export import load_export_meta
from openjev.tools import launch
from openjev.v1 import decision_pb2 as api
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = json.loads((REPO / "examples" / "contract_example.json").read_text())


def reference_answers(demo_model, request: dict, policy: str = "off") -> dict:
    """The same request computed in-process: contract rendering, tokenizer, torch runner, engine."""
    return reference(demo_model, request, policy)[0]


def reference(demo_model, request: dict, policy: str = "off"):
    """(answers, the engine's ExecutionResult) of the request computed in-process."""
    from openjev.contract.answers import answer_from_probabilities
    from openjev.contract.request import parse_request
    from openjev.export import load_export_meta
    from openjev.tokenizer import PromptTokenizer
    from openjev.worker.engine import Engine, QuestionWork
    from openjev.worker.model.runner import TorchRunner

    meta = load_export_meta(demo_model)
    decision = parse_request(request, accepted_models=meta.accepted_model_names)
    tokenizer = PromptTokenizer.from_export(demo_model)
    work = [QuestionWork(q.kind, tokenizer.encode(list(q.prompts))) for q in decision.questions]
    result = Engine(TorchRunner(demo_model)).execute(work, temperature=meta.temperature, policy=policy)
    answers = {
        q.id: answer_from_probabilities(q, p) for q, p in zip(decision.questions, result.probabilities, strict=True)
    }
    return answers, result


def assert_answers_close(got, want, tolerance: float, path: str = "answers") -> None:
    """Every field of every answer (choice, confidence, score, legend, probabilities): numbers
    within `tolerance`, everything else equal, keys in the same order. Probabilities alone were
    compared once, so a frontend that swapped score and confidence passed."""
    if isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, abs_tol=tolerance), (path, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (path, got, want)
        for key in want:
            assert_answers_close(got[key], want[key], tolerance, f"{path}.{key}")
    else:
        assert got == want, (path, got, want)


def test_contract_example_answered(client, demo_model):
    response = client.decide(EXAMPLE, policy="off", timeout=60)
    assert list(response) == ["model", "answers", "usage", "metadata"]
    assert response["model"] == "open-jev-demo"
    assert list(response["answers"]) == ["route", "refund_review", "urgency"]
    route = response["answers"]["route"]
    assert list(route["probabilities"]) == ["billing", "security", "technical"]
    assert math.isclose(sum(route["probabilities"].values()), 1.0, abs_tol=1e-12)
    urgency = response["answers"]["urgency"]
    assert list(urgency["legend"].values()) == EXAMPLE["questions"]["urgency"]["criteria"]
    meta = response["metadata"]
    assert meta["candidate_sequences"] == 7
    assert meta["max_length"] == 16384
    assert meta["prefix_cache"] == {"policy": "off", "enabled": False, "scope": "none", "saved_tokens": 0}
    assert response["usage"]["output_tokens"] == 0
    assert meta["inference_seconds"] > 0
    assert (meta["method"], meta["temperature"]) == ("open-jev-scalar-head", load_export_meta(demo_model).temperature)
    assert_answers_close(response["answers"], reference_answers(demo_model, EXAMPLE), 1e-6)


def test_prefix_metadata_is_the_engines(client, demo_model):
    """What the worker's planner did (policy, scope, tokens saved) reaches the response as it is."""
    for policy in ("shared", "default"):
        answers, result = reference(demo_model, EXAMPLE, policy)
        response = client.decide(EXAMPLE, policy=policy, timeout=60)
        assert result.num_saved_tokens > 0
        assert response["metadata"]["prefix_cache"] == {
            "policy": policy,
            "enabled": True,
            "scope": result.scope,
            "saved_tokens": result.num_saved_tokens,
        }
        assert_answers_close(response["answers"], answers, 1e-6)


def test_input_tokens_count_every_candidate(client, demo_model):
    from openjev.contract.request import parse_request
    from openjev.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer.from_export(demo_model)
    decision = parse_request(EXAMPLE, accepted_models={"open-jev-demo"})
    expected = sum(len(ids) for q in decision.questions for ids in tokenizer.encode(list(q.prompts)))
    for policy in ("off", "shared"):
        assert client.decide(EXAMPLE, policy=policy, timeout=60)["usage"]["input_tokens"] == expected


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "openjev.tools.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_decide_and_tokenize(pair, demo_model, tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(EXAMPLE))
    out = _cli("decide", str(path), "--addr", pair.frontend.address, "--policy", "off")
    assert out.returncode == 0, out.stderr
    assert list(json.loads(out.stdout)["answers"]) == ["route", "refund_review", "urgency"]
    fixture = json.loads((REPO / "tests" / "contract" / "data" / "tokenization_cases.json").read_text())
    path.write_text(json.dumps(fixture["cases"][0]["request"]))
    out = _cli("tokenize", str(path), "--model", str(demo_model))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == fixture["cases"][0]["ids"]


def test_cli_error_prints_status_and_exits_nonzero(pair, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"questions": {}}))
    out = _cli("decide", str(path), "--addr", pair.frontend.address)
    assert out.returncode != 0
    assert "INVALID_ARGUMENT: request requires state" in out.stderr
    # with the id the frontend gave the call, which its log lines carry: what to quote to its operator
    [request_id] = re.findall(r"\(request id (\w+)\)$", out.stderr.strip())
    assert any(request_id in line for line in pair.frontend.log_text().splitlines() if '"decide"' in line)


def test_cli_request_that_is_not_utf8_is_the_contracts_error(pair, tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"state": "café", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}'.encode("latin-1"))
    out = _cli("decide", str(path), "--addr", pair.frontend.address)
    assert out.returncode == 1
    assert out.stderr.strip() == "error: INVALID_ARGUMENT: request body must be valid JSON"


class _WrongAbiWorker(worker_pb2_grpc.WorkerServiceServicer):
    """A worker from another release: answers Describe with a different ABI version."""

    def __init__(self, describe: wire.DescribeResponse):
        self.describe = describe
        self.executed = 0

    def Describe(self, request, context):
        return self.describe

    def Execute(self, request_iterator, context):
        self.executed += 1
        context.abort(grpc.StatusCode.INTERNAL, "must never be called")


def test_frontend_refuses_worker_with_other_abi_version(pair, demo_model, tmp_path):
    real = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(pair.worker.address)).Describe(
        wire.DescribeRequest()
    )
    real.abi_version = abi.ABI_VERSION + 1
    fake = _WrongAbiWorker(real)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    frontend = launch.start_frontend(demo_model, f"127.0.0.1:{port}", tmp_path)
    try:
        with pytest.raises(launch.LaunchError):
            launch.wait_serving(frontend.address, timeout_seconds=3)
        with Client(frontend.address) as c, pytest.raises(grpc.RpcError) as caught:
            c.decide(EXAMPLE, timeout=30)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"ABI version {abi.ABI_VERSION + 1}" in caught.value.details()
        assert f"ABI version {abi.ABI_VERSION}" in caught.value.details()
        assert fake.executed == 0
    finally:
        frontend.stop()
        server.stop(0)


def test_frontend_refuses_worker_with_other_tokenizer(pair, demo_model, tmp_path):
    other = tmp_path / "other-export"
    shutil.copytree(demo_model, other)
    meta_path = other / "open_jev_export.json"
    meta = json.loads(meta_path.read_text())
    meta["chat_suffix"] = meta["chat_suffix"] + " "
    meta_path.write_text(json.dumps(meta))
    frontend = launch.start_frontend(other, pair.worker.address, tmp_path)
    try:
        with Client(frontend.address) as c, pytest.raises(grpc.RpcError) as caught:
            c.decide(EXAMPLE, timeout=30)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "tokenizer fingerprint" in caught.value.details()
    finally:
        frontend.stop()


def test_killed_worker_gives_unavailable_not_a_hang(demo_model, tmp_path):
    own = launch.start_pair(demo_model, tmp_path)
    try:
        with Client(own.frontend.address) as c:
            c.decide(EXAMPLE, timeout=60)
            own.worker.kill()
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                c.decide(EXAMPLE, timeout=30)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 10
            # a request's own fault is still INVALID_ARGUMENT, worker or not (it was UNAVAILABLE)
            too_long = {**EXAMPLE, "state": "word " * 20000}
            with pytest.raises(grpc.RpcError) as caught:
                c.decide(too_long, timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "exceeds max_length=16384; no silent truncation" in caught.value.details()
    finally:
        own.stop()


def test_with_no_worker_a_request_whose_caller_left_is_not_checked_to_its_end(demo_model, tmp_path):
    """No worker: the frontend still checks a request's lengths (its own fault is
    INVALID_ARGUMENT), but stops at the batch after the caller's deadline passed. A request of
    seconds of tokenizing was checked to its end and logged UNAVAILABLE for a caller long gone."""
    from openjev.tools.soak import log_events

    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    questions = {
        f"q{i}": {
            "type": "choice",
            "instructions": f"Pick {i}",
            "criteria": {f"c{j}": " ".join(f"{words[(j + k) % 8]}{i}x{j}x{k}" for k in range(200)) for j in range(250)},
        }
        for i in range(16)
    }
    frontend = launch.start_frontend(demo_model, f"127.0.0.1:{launch.free_port()}", tmp_path)
    try:
        with Client(frontend.address) as c:
            with pytest.raises(grpc.RpcError) as caught:
                c.decide(EXAMPLE, timeout=30)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # the link knows it has no worker
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                c.decide({"state": "A state.", "questions": questions}, timeout=1.0, request_id="gone")
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - started < 10
            deadline = time.monotonic() + 30  # the log line comes when the frontend stops checking
            while not (events := [e for e in log_events(frontend.log_text(), "decide") if e["request_id"] == "gone"]):
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        frontend.stop()
    assert events[0]["status"] == "DEADLINE_EXCEEDED", events
    # checked to its end, it is refused at the token limit after 2.9 s on a 2-core machine
    assert events[0]["latency_ms"] < 2500, events


def test_describe_model(client):
    reply = client.stub.DescribeModel(api.DescribeModelRequest(), timeout=10)
    assert reply.model_id == "open-jev-demo"
    assert {"open-jev", "jev-latest", "open-jev-demo"} <= set(reply.accepted_names)
    assert reply.backend == "torch"


def test_the_request_id_comes_back_in_trailing_metadata(client):
    """The id the frontend's and worker's log lines carry: the caller's x-request-id, or the one
    the frontend made (for a refusal too), so a gRPC caller can quote it as an HTTP caller can."""
    message = api.DecideRequest(request_json=json.dumps(EXAMPLE))
    _, call = client.stub.Decide.with_call(message, timeout=60, metadata=[("x-request-id", "trace-me-7")])
    assert ("x-request-id", "trace-me-7") in call.trailing_metadata()
    _, call = client.stub.Decide.with_call(message, timeout=60)
    made = dict(call.trailing_metadata())["x-request-id"]
    assert len(made) == 32 and int(made, 16) >= 0
    # an id the logs and the worker's metadata should not carry (as on HTTP: over 128 characters,
    # or not printable ASCII) is replaced by one the frontend makes
    for bad in ("x" * 7000, "two words"):
        _, call = client.stub.Decide.with_call(message, timeout=60, metadata=[("x-request-id", bad)])
        made = dict(call.trailing_metadata())["x-request-id"]
        assert made != bad and len(made) == 32 and int(made, 16) >= 0
    with pytest.raises(grpc.RpcError) as caught:
        client.stub.Decide(api.DecideRequest(request_json="{}"), timeout=60, metadata=[("x-request-id", "bad-1")])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("x-request-id", "bad-1") in caught.value.trailing_metadata()


def test_cli_mistakes_are_one_line(tmp_path, demo_model):
    """A missing file, a folder, or a directory that is no export: one line and exit 1, no
    traceback; `openjev bench` takes the benchmark's own flags."""
    missing = tmp_path / "nope.json"
    cases = [
        (("decide", str(missing)), f"error: cannot read request {missing}: No such file or directory"),
        (("decide", str(tmp_path)), f"error: cannot read request {tmp_path}: Is a directory"),
        (("decide", str(demo_model / "config.json"), "--tls-ca", str(missing)), "error: cannot read CA"),
        (("tokenize", str(missing), "--model", str(demo_model)), "error: cannot read request"),
        (("tokenize", "-", "--model", str(tmp_path)), "openjev tokenize: open_jev_export.json: missing"),
    ]
    for args, want in cases:
        out = _cli(*args)
        assert out.returncode == 1 and "Traceback" not in out.stderr, (args, out.stderr)
        assert out.stderr.strip().splitlines()[-1].startswith(want), (args, out.stderr)
    bench = _cli("bench", "--help")
    assert bench.returncode == 0 and "--first-seen-seed" in bench.stdout, bench.stderr
