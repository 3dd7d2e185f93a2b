"""Faults: a worker killed mid-request, a worker that answers garbage, a runner that fails, a
corrupt or truncated checkpoint."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from fake_worker import fake_describe, serve_fake
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openjev import abi
from openjev.client import Client
from openjev.contract.answers import answer_from_probabilities
from openjev.contract.request import parse_request
from openjev.tools import launch
from openjev.tools.soak import comparable, log_events
from openjev.v1 import decision_pb2 as api
from openjev.worker.runner_api import SegmentResult
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

SMALL = {
    "state": "A customer says: I was charged twice.",
    "questions": {
        "route": {"type": "choice", "instructions": "Team?", "criteria": {"billing": None, "hr": None, "it": None}},
        "urgent": {"type": "noul", "instructions": "Urgent?"},
    },
}
LONG = {
    "state": "word " * 2000,
    "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(16)}}},
}


def test_worker_killed_mid_request_is_unavailable_and_frontend_recovers(demo_model, tmp_path):
    port = launch.free_port()
    worker_args = ["--listen", f"127.0.0.1:{port}", "--max-launch-sequences", "1"]
    worker = launch.start_worker(demo_model, tmp_path, worker_args)
    frontend = launch.start_frontend(demo_model, worker.address, tmp_path, ["--worker-refresh-seconds", "0.5"])
    try:
        launch.wait_serving(frontend.address)
        with Client(frontend.address) as client:
            before = comparable(client.decide(SMALL, timeout=60))
            future = client.stub.Decide.future(  # policy off: ~8 s of work, no shared prefix
                api.DecideRequest(request_json=json.dumps(LONG), prefix_policy=api.PREFIX_POLICY_OFF), timeout=60
            )
            time.sleep(1.0)
            worker.kill()
            killed_at = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                future.result()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - killed_at < 5
            with pytest.raises(grpc.RpcError) as caught:  # while it is down: UNAVAILABLE, quickly
                client.decide(SMALL, timeout=30)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            worker = launch.start_worker(demo_model, tmp_path, worker_args, name="worker-restarted")
            # SERVING again means the traffic channel is connected too: the next request works
            launch.wait_serving(frontend.address, timeout_seconds=30)
            after = client.decide(SMALL, timeout=60)
            assert comparable(after) == before
    finally:
        frontend.stop()
        worker.stop()


# -- a worker that answers garbage, and a real worker servicer over a failing runner ----------


class _FaultyRunner:
    backend = "torch"

    def __init__(self):
        self.mode = "nan_score"

    def run_launch(self, runs):
        if self.mode == "raise":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if self.mode == "short":
            return [SegmentResult(None, 0.5) for _ in runs[:-1]]
        return [SegmentResult(object() if r.keep_state else None, math.nan if r.read_head else None) for r in runs]


class _BadWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Answers Execute, and ExecuteUnary where its Describe offers it, with the fault `mode`."""

    def __init__(self, describe: wire.DescribeResponse, real):
        self.describe = describe
        self.real = real  # a real WorkerServicer over _FaultyRunner
        self.mode = "nan"
        self.calls = {"Execute": 0, "ExecuteUnary": 0}

    def Describe(self, request, context):
        return self.describe

    def Execute(self, request_iterator, context):
        self.calls["Execute"] += 1
        if self.mode.startswith("runner:"):
            yield from self.real.Execute(request_iterator, context)
            return
        header, tokens = None, 0
        for message in request_iterator:
            if message.WhichOneof("item") == "header":
                header = message.header
            elif message.WhichOneof("item") == "batch":
                tokens += sum(len(c.token_ids) for c in message.batch.candidates)
        if self.mode == "empty_message":  # a reply message with nothing in it, taken for the summary
            yield wire.ExecuteResponse()
        for question, summary in self._replies(header, context, tokens):
            yield wire.ExecuteResponse(question=question) if summary is None else wire.ExecuteResponse(summary=summary)
            if summary is not None and self.mode == "second_summary":
                yield wire.ExecuteResponse(summary=summary)

    def ExecuteUnary(self, request, context):
        self.calls["ExecuteUnary"] += 1
        if self.mode.startswith("runner:"):
            return self.real.ExecuteUnary(request, context)
        reply = wire.ExecuteUnaryResponse()
        tokens = sum(len(c.token_ids) for c in request.candidates)
        for question, summary in self._replies(request.header, context, tokens):
            if summary is None:
                reply.questions.append(question)
            elif self.mode not in ("empty_message", "second_summary"):  # a reply of one message: none
                reply.summary.CopyFrom(summary)
        return reply

    def _replies(self, header: wire.ExecuteHeader, context, tokens: int):
        """(question result, None) or (None, summary), in the order a stream would send them; the
        faults are in the first question (SMALL's route: 3 options)."""

        def result(index, probabilities):
            return wire.QuestionResult(question_index=index, probabilities=probabilities), None

        sizes = [2 if q.kind == wire.QUESTION_KIND_NOUL else q.num_candidates for q in header.questions]
        good = [[1.0 / size] * size for size in sizes]
        n = len(good)
        if self.mode == "abort":
            context.abort(grpc.StatusCode.NOT_FOUND, "something odd")
        bad = {
            "nan": [math.nan, 0.5, 0.5],
            "inf": [math.inf, 0.0, 0.0],
            "count": [1.0],
            "sum": [0.7, 0.7, 0.7],
            "negative": [-0.5, 1.5, 0.0],
            "below_zero": [-0.1, 0.6, 0.5],  # in [.., 1] and summing to 1: only the lower bound refuses it
        }
        if self.mode in bad:
            for i, p in enumerate([bad[self.mode], *good[1:]]):
                yield result(i, p)
        elif self.mode == "out_of_range":
            yield result(n + 3, good[0])
        elif self.mode == "twice":
            yield result(0, good[0])
            yield result(0, good[0])
        elif self.mode == "missing":
            yield result(0, good[0])
        else:
            for i in range(n):
                yield result(i, good[i])
        if self.mode != "no_summary":
            off, none = abi.policy_to_enum("off"), abi.scope_to_enum("none")
            summary = wire.ExecutionSummary(
                policy=off, executed_policy=off, scope=none, submitted_tokens=tokens, computed_tokens=tokens
            )
            if self.mode == "summary_unknown":  # enum values of a newer build, passed on as "unknown-77"
                summary.policy, summary.scope = 77, 99  # type: ignore[assignment]
            elif self.mode == "summary_tokens":
                summary.submitted_tokens = summary.computed_tokens = tokens + 1
            elif self.mode == "summary_sum":  # one token neither computed nor saved
                summary.computed_tokens = tokens - 1
            elif self.mode == "summary_enabled":  # reuse said enabled, nothing saved
                summary.prefix_enabled = True
            elif self.mode in ("summary_negative_time", "summary_nan_time"):
                summary.inference_seconds = -1.0 if self.mode == "summary_negative_time" else math.nan
            yield None, summary


@pytest.fixture(scope="module", params=["Execute", "ExecuteUnary"])
def bad_worker(demo_model, tmp_path_factory, request):
    """The faulty worker behind a real frontend, offering ExecuteUnary or not (the path tested)."""
    from openjev.export import load_export_meta
    from openjev.worker.engine import Engine
    from openjev.worker.service import WorkerIdentity, WorkerServicer

    meta = load_export_meta(demo_model)
    describe = fake_describe(demo_model, request.param == "ExecuteUnary")
    identity = WorkerIdentity(
        meta.model_id,
        meta.alias,
        "fake",
        meta.temperature,
        meta.max_length,
        10**6,
        describe.tokenizer_fingerprint,
        describe.weights_fingerprint,
        "torch",
        "off",
        4096,
        65536,
        16,
        16,
        4096,
        4,
    )
    runner = _FaultyRunner()
    real = WorkerServicer(Engine(runner, queue_capacity=4), identity)
    fake = _BadWorker(describe, real)
    server, port = serve_fake(fake)
    frontend = launch.start_frontend(demo_model, f"127.0.0.1:{port}", tmp_path_factory.mktemp("bad-worker"))
    launch.wait_serving(frontend.address)
    yield fake, runner, frontend
    frontend.stop()
    server.stop(0)


def bad_worker_path(fake: _BadWorker) -> str:
    return "ExecuteUnary" if fake.describe.execute_unary else "Execute"


@pytest.mark.parametrize(
    "mode,reason",
    [
        ("nan", "invalid probabilities for question route"),
        ("inf", "invalid probabilities for question route"),
        ("count", "invalid probabilities for question route"),
        ("sum", "invalid probabilities for question route"),
        ("negative", "invalid probabilities for question route"),
        ("below_zero", "invalid probabilities for question route"),
        ("out_of_range", "twice or out of range"),
        ("twice", "twice or out of range"),
        ("missing", "without a complete result"),
        ("no_summary", "without a complete result"),
        ("summary_unknown", "invalid summary: an unknown prefix policy or scope"),
        ("summary_tokens", "tokens submitted where"),
        ("summary_sum", "computed and saved tokens do not add up to those submitted"),
        ("summary_enabled", "prefix reuse said enabled without saved tokens"),
        ("summary_negative_time", "a negative or non-finite inference time"),
        ("summary_nan_time", "a negative or non-finite inference time"),
        # the stream's malformed replies; a one-message reply without its summary
        ("empty_message", {"Execute": "malformed reply", "ExecuteUnary": "without a complete result"}),
        ("second_summary", {"Execute": "malformed reply", "ExecuteUnary": "without a complete result"}),
        ("abort", "worker: something odd"),
        ("runner:nan_score", "non-finite head score"),
        ("runner:raise", "illegal memory access"),
        ("runner:short", "results for"),
    ],
)
def test_malformed_or_non_finite_worker_result_is_internal(bad_worker, mode, reason):
    fake, runner, frontend = bad_worker
    fake.mode = mode
    runner.mode = mode.removeprefix("runner:")
    reason = reason if isinstance(reason, str) else reason[bad_worker_path(fake)]
    request_id = f"fault-{mode}-{uuid.uuid4().hex[:8]}"
    calls = dict(fake.calls)
    with Client(frontend.address) as client, pytest.raises(grpc.RpcError) as caught:
        client.decide(SMALL, timeout=30, request_id=request_id)
    assert {m: n - calls[m] for m, n in fake.calls.items() if n != calls[m]} == {bad_worker_path(fake): 1}
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    # the caller learns that inference failed and under which id; the reason is the log's
    assert caught.value.details() == f"model inference failed (request id {request_id})"
    time.sleep(0.1)
    lines = [r for r in log_events(frontend.log_text(), "decide") if r.get("request_id") == request_id]
    assert len(lines) == 1 and lines[0]["status"] == "INTERNAL" and reason in lines[0]["reason"]
    assert lines[0]["level"] == "error"


def test_a_worker_that_takes_fewer_candidates_a_message_is_refused(demo_model, tmp_path):
    """The frontend sends batches of 16 candidates; a worker stating fewer a message (Describe's
    max_batch_candidates) was taken as compatible, and every request of more candidates failed
    INTERNAL after its retries. It is now an incompatible worker, named, as smaller limits are."""
    describe = fake_describe(demo_model, execute_unary=True)
    describe.limits.max_batch_candidates = 4
    fake = _BadWorker(describe, None)
    fake.mode = "good"
    server, port = serve_fake(fake)
    frontend = launch.start_frontend(demo_model, f"127.0.0.1:{port}", tmp_path)
    try:
        with Client(frontend.address) as client, pytest.raises(grpc.RpcError) as caught:
            client.decide(SMALL, timeout=30)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "accepts at most 4 candidates per message, fewer than the 16 this frontend sends" in (
            caught.value.details()
        )
        assert fake.calls == {"Execute": 0, "ExecuteUnary": 0}
    finally:
        frontend.stop()
        server.stop(0)


def test_a_well_formed_reply_of_the_fake_is_answered(bad_worker):
    """The control for the faults above: the fake's good questions and summary pass every check."""
    fake, _, frontend = bad_worker
    fake.mode = "good"
    with Client(frontend.address) as client:
        reply = client.decide(SMALL, timeout=30)
    decision = parse_request(SMALL, accepted_models={reply["model"]})
    sizes = [2 if q.kind == "noul" else len(q.options) for q in decision.questions]
    assert reply["answers"] == {
        q.id: answer_from_probabilities(q, [1.0 / size] * size)
        for q, size in zip(decision.questions, sizes, strict=True)
    }
    assert reply["metadata"]["prefix_cache"] == {"policy": "off", "enabled": False, "scope": "none", "saved_tokens": 0}


def test_a_caller_gone_before_acceptance_gets_its_log_line(bad_worker):
    """A caller that leaves while the worker reads and checks its request makes the accepting
    response headers fail to send: the request is still logged (it was counted, unlogged)."""
    import structlog

    fake, _, _ = bad_worker

    class Gone(grpc.RpcError):
        pass

    class Aborted(Exception):
        pass

    class LeftContext:  # the fault: the caller is gone when the headers go out
        def invocation_metadata(self):
            return (("x-request-id", "gone-before-acceptance"),)

        def send_initial_metadata(self, metadata):
            raise Gone()

        def abort(self, code, details):
            raise Aborted(code, details)

        def is_active(self):
            return False

        def time_remaining(self):  # no deadline: the caller cancelled
            return None

    request = wire.ExecuteUnaryRequest(header=wire.ExecuteHeader(request_id="gone-before-acceptance"))
    request.header.questions.add(kind=abi.kind_to_enum("noul"), num_candidates=1)
    request.candidates.add(question_index=0, candidate_index=0, token_ids=[1, 2, 3])
    with structlog.testing.capture_logs() as lines, pytest.raises(Aborted) as aborted:
        fake.real.ExecuteUnary(request, LeftContext())
    assert aborted.value.args == (grpc.StatusCode.CANCELLED, "client went away before acceptance")
    executes = [line for line in lines if line["event"] == "execute"]
    assert [(e["status"], e["reason"]) for e in executes] == [("CANCELLED", "client went away before acceptance")]


# -- corrupt or truncated checkpoints ------------------------------------------------------------


def _variant(demo_model: Path, root: Path, name: str, damage) -> Path:
    out = root / name
    out.mkdir()
    for path in demo_model.iterdir():
        if path.name != "model.safetensors" and not path.name.startswith("."):
            (out / path.name).symlink_to(path)
    data = (demo_model / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(damage(data))
    return out


CORRUPTIONS = {
    "truncated": (lambda b: b[: len(b) // 2], "model.safetensors: truncated safetensors file"),
    "no header": (lambda b: b[:5], "model.safetensors: truncated safetensors file (no header)"),
    "header past end": (
        lambda b: (2**40).to_bytes(8, "little") + b[8:],
        "model.safetensors: truncated safetensors file",
    ),
    "garbled header": (lambda b: b[:8] + b"\xff" * 64 + b[72:], "model.safetensors: safetensors header is not JSON"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupt_checkpoint_is_refused_at_start_naming_the_file(demo_model, tmp_path, name):
    damage, message = CORRUPTIONS[name]
    model = _variant(demo_model, tmp_path, name.replace(" ", "-"), damage)
    out = subprocess.run(
        [sys.executable, "-m", launch.WORKER_MODULE, "--model", str(model), "--listen", "127.0.0.1:0", "--plaintext"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_corrupt_export_metadata_is_refused_by_both_servers(demo_model, tmp_path):
    model = tmp_path / "bad-meta"
    shutil.copytree(demo_model, model, symlinks=False, ignore=shutil.ignore_patterns("model.safetensors"))
    (model / "model.safetensors").symlink_to(demo_model / "model.safetensors")
    text = (model / "open_jev_export.json").read_text()
    (model / "open_jev_export.json").write_text(text[: len(text) // 2])
    for module in (launch.WORKER_MODULE, launch.FRONTEND_MODULE):
        out = subprocess.run(
            [sys.executable, "-m", module, "--model", str(model), "--listen", "127.0.0.1:0", "--plaintext"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0
        assert "open_jev_export.json: not readable JSON" in out.stderr and "Traceback" not in out.stderr, out.stderr[
            -2000:
        ]


def test_a_worker_that_cancels_an_uncommitted_stream_is_unavailable_not_cancelled(demo_model, tmp_path):
    """A worker cancels an Execute stream not committed within --commit-timeout-seconds (here
    1 ms, shorter than tokenizing 1,000 candidates): the client, which cancelled nothing, gets
    UNAVAILABLE saying so (it got CANCELLED, which reads as its own doing), after the retries.
    (With 200 a loaded machine once answered it: a stream wholly buffered before the worker's
    handler started commits at once.)"""
    worker = launch.start_worker(demo_model, tmp_path, ["--commit-timeout-seconds", "0.001"])
    frontend = launch.start_frontend(demo_model, worker.address, tmp_path)
    many = {
        "state": "A customer says: I was charged twice.",
        "questions": {
            f"q{q}": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(250)}}
            for q in range(4)
        },
    }
    try:
        launch.wait_serving(frontend.address)
        with Client(frontend.address) as client, pytest.raises(grpc.RpcError) as caught:
            client.decide(many, timeout=60, request_id="uncommitted")
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
        assert "commit timeout" in (caught.value.details() or "")
        retries = log_events(frontend.log_text(), "worker_retry")
        assert len(retries) == 2 and all(e["request_id"] == "uncommitted" for e in retries)
    finally:
        frontend.stop()
        worker.stop()


class _ConstantRunner:
    backend = "torch"

    def run_launch(self, runs):
        return [SegmentResult(object() if r.keep_state else None, 0.0 if r.read_head else None) for r in runs]


def test_work_calls_before_the_warm_up_is_over_are_unavailable_and_unaccepted():
    """The worker's server starts (NOT_SERVING) before its warm-up, whose CUDA graph captures a
    pass run beside them would break (the captures fail, and those shapes run eagerly for good):
    a work call then is UNAVAILABLE without the accepted header, so a frontend tries another
    worker; once the worker is ready the same call is answered. Calls were served during it."""
    from openjev.worker.engine import Engine
    from openjev.worker.service import WorkerIdentity, WorkerServicer

    identity = WorkerIdentity("m", None, "r", 1.0, 64, 1000, "fp", "wfp", "torch", "off", 4, 64, 16, 16, 4096, 4)
    servicer = WorkerServicer(Engine(_ConstantRunner(), queue_capacity=4), identity, ready=False)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    request = wire.ExecuteUnaryRequest(header=wire.ExecuteHeader(request_id="early"))
    request.header.questions.add(kind=abi.kind_to_enum("noul"), num_candidates=1)
    request.candidates.add(question_index=0, candidate_index=0, token_ids=[1, 2, 3])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.ExecuteUnary(request, timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "starting" in caught.value.details()
            assert abi.ACCEPTED_METADATA_KEY not in dict(caught.value.initial_metadata())
            servicer.ready.set()
            reply = stub.ExecuteUnary(request, timeout=10)
            assert list(reply.questions[0].probabilities) == [0.5, 0.5]
    finally:
        server.stop(0)
        servicer.engine.close()


class _LostDevice:
    """A runner whose passes fail; `sticky`: the device can run nothing more afterwards."""

    backend = "cuda"

    def __init__(self, sticky: bool):
        self.sticky = sticky
        self.probes = 0

    def run_launch(self, runs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def device_lost(self):
        self.probes += 1
        return "CUDA error: an illegal memory access was encountered" if self.sticky else None


@pytest.mark.parametrize("sticky", [True, False])
def test_a_device_that_can_run_nothing_more_is_reported_once(sticky):
    """After a failed pass the scheduler asks the runner whether its device still works: a sticky
    CUDA error (every later pass fails while health said SERVING) reaches on_device_lost once,
    and the worker stops serving and exits 1 on it; a pass's own failure (an out-of-memory) does
    not."""
    from openjev.worker.engine import Engine, InferenceError, QuestionWork

    runner, lost = _LostDevice(sticky), []
    engine = Engine(runner, default_policy="off", on_device_lost=lost.append)
    try:
        for _ in range(2):
            with pytest.raises(InferenceError, match="illegal memory access"):
                engine.execute([QuestionWork("noul", ((1, 2, 3),))], temperature=1.0)
    finally:
        engine.close()
    assert runner.probes == (1 if sticky else 2)  # reported once: the probe is not asked again
    assert lost == (["CUDA error: an illegal memory access was encountered"] if sticky else [])


def test_serving_ends_when_the_server_itself_stops_it():
    """serve_until_signal's `stop` (set on a lost device) ends serving as SIGTERM does: health
    NOT_SERVING for good, the server stopped, and the caller's cleanup run."""
    import signal
    import threading

    from openjev import serving

    server = serving.build_server("127.0.0.1:0", lambda s: None, [])
    server.set_serving(True)
    stop, stopped = threading.Event(), []
    threading.Timer(0.2, stop.set).start()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serving.serve_until_signal(server, grace_seconds=1.0, on_stop=lambda: stopped.append(True), stop=stop)
    finally:  # it took this process's SIGTERM and SIGINT
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert stopped == [True]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.RpcError) as caught:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
