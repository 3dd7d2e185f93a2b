"""Two CPU workers behind one round-robin frontend (`--worker-affinity off`), all real
subprocesses on loopback: round-robin spread, a worker killed under a steady stream of requests,
and the worker coming back; an incompatible worker among compatible ones; bad `--worker` targets.

Which worker ran what is read from the workers' own JSON logs (`execute_accepted` when a
worker took a request, `execute` with status OK when it answered), keyed by the request id the
client sends: that is also the check that the id travels from frontend to worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from other_export import other_export

from openjev.client import Client
from openjev.tools import launch
from openjev.v1 import decision_pb2 as api
from openjev.v1 import decision_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = json.loads((REPO / "examples" / "contract_example.json").read_text())
# Long enough (about two seconds on CI's CPU) to be certainly executing when its worker dies.
SLOW = {
    "state": "A long customer message. " * 60,
    "questions": {
        "q": {"type": "choice", "instructions": "Pick one.", "criteria": {f"option {i}": None for i in range(24)}}
    },
}
WORKER_ARGS = ["--log-level", "debug", "--grace-seconds", "2"]


def log_events(process: launch.Process, event: str, status: str | None = None) -> list[str]:
    """Request ids of the worker's log lines of that event (and status)."""
    ids = []
    for line in process.log_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event and (status is None or entry.get("status") == status):
            ids.append(entry.get("request_id"))
    return ids


def start_worker(demo_model: Path, workdir: Path, port: int, name: str) -> launch.Process:
    return launch.start_worker(demo_model, workdir, ["--listen", f"127.0.0.1:{port}", *WORKER_ARGS], name=name)


@pytest.fixture(scope="module")
def cluster(demo_model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("multi")
    ports = [launch.free_port(), launch.free_port()]
    with futures.ThreadPoolExecutor(2) as pool:  # both load at once: start-up is most of the cost
        workers = list(pool.map(lambda i: start_worker(demo_model, workdir, ports[i], f"worker-{i}"), range(2)))
    # Round robin (affinity off): the same request spreads; tests/test_affinity_routing.py has affinity.
    frontend = launch.start_frontend(
        demo_model,
        ",".join(w.address for w in workers),
        workdir,
        ["--worker-refresh-seconds", "0.5", "--worker-affinity", "off"],
    )
    state = {"workers": workers, "ports": ports, "frontend": frontend, "workdir": workdir, "extra": []}
    try:
        launch.wait_serving(frontend.address)
        yield state
    finally:
        for process in (frontend, *workers, *state["extra"]):
            process.stop(timeout_seconds=10)


def test_requests_spread_over_both_workers(cluster):
    ids = [f"spread-{i}" for i in range(8)]
    with Client(cluster["frontend"].address) as c:
        for request_id in ids:
            c.decide(EXAMPLE, request_id=request_id, timeout=60)
    time.sleep(0.2)
    served = [set(log_events(w, "execute", "OK")) & set(ids) for w in cluster["workers"]]
    assert served[0] | served[1] == set(ids)
    assert not served[0] & served[1], "a request was answered by two workers"
    assert len(served[0]) >= 2 and len(served[1]) >= 2, served  # round_robin, not pick_first


class Stream:
    """Client threads sending EXAMPLE back to back, each request with its own id, until stopped."""

    def __init__(self, address: str, threads: int = 2):
        self.address = address
        self.results: list[tuple[str, float, str, dict | None]] = []  # (id, sent_at, outcome, answers)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads), "a request never returned"

    def ok_since(self, since: float) -> int:
        with self._lock:
            return sum(1 for _, sent, outcome, _ in self.results if outcome == "OK" and sent >= since)

    def _run(self, index: int) -> None:
        with Client(self.address) as c:
            n = 0
            while not self._stop.is_set():
                request_id, sent, n = f"stream-{index}-{n}", time.monotonic(), n + 1
                try:
                    answers, outcome = c.decide(EXAMPLE, request_id=request_id, timeout=30)["answers"], "OK"
                except grpc.RpcError as error:
                    answers, outcome = None, error.code().name
                with self._lock:
                    self.results.append((request_id, sent, outcome, answers))


def same_answers(got: dict, want: dict) -> bool:
    """Both workers load the same weights; answers agree up to float noise."""

    def numbers(answers):
        return [v for a in answers.values() for v in ([a.get("noul", 0.0)] + list(a.get("probabilities", {}).values()))]

    got_numbers, want_numbers = numbers(got), numbers(want)
    return (
        list(got) == list(want)
        and len(got_numbers) == len(want_numbers)
        and all(abs(g - w) <= 1e-9 for g, w in zip(got_numbers, want_numbers, strict=True))
    )


def wait_for(condition, timeout_seconds: float, what: str) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_worker_killed_under_load_then_rejoins(cluster, demo_model):
    frontend = cluster["frontend"]
    victim, survivor = cluster["workers"]
    with Client(frontend.address) as c:
        reference = c.decide(EXAMPLE, timeout=60)["answers"]
    slow_result: dict = {}

    def send_slow() -> None:
        with Client(frontend.address) as c:
            try:
                c.decide(SLOW, policy="off", request_id="slow", timeout=60)
                slow_result["outcome"] = "OK"
            except grpc.RpcError as error:
                slow_result["outcome"] = error.code().name

    with Stream(frontend.address) as stream:
        wait_for(lambda: stream.ok_since(0) >= 6, 30, "traffic before the kill")
        slow = threading.Thread(target=send_slow)
        slow.start()
        # its first pass began: `execute_accepted` is logged before the worker sends the header
        # that tells the frontend it accepted the call (killed in between, the call is retried)
        wait_for(
            lambda: "slow" in log_events(victim, "execute_started") + log_events(survivor, "execute_started"),
            30,
            "the slow request to start",
        )
        if "slow" in log_events(survivor, "execute_started"):
            victim, survivor = survivor, victim  # kill the worker that runs the slow request
        victim.kill()
        killed_at = time.monotonic()
        slow.join(60)
        wait_for(lambda: stream.ok_since(killed_at + 0.5) >= 6, 30, "traffic on the survivor")

        # The same address comes back: gRPC reconnects to it and health makes it eligible again.
        index = cluster["workers"].index(victim)
        restarted = start_worker(demo_model, cluster["workdir"], cluster["ports"][index], f"worker-{index}-restarted")
        cluster["extra"].append(restarted)
        wait_for(
            lambda: any(i.startswith("stream-") for i in log_events(restarted, "execute", "OK")),
            30,
            "the restarted worker to serve stream requests",
        )

    assert slow_result["outcome"] == "UNAVAILABLE", "an executing request must fail, not run again elsewhere"
    assert "slow" not in log_events(survivor, "execute_accepted") + log_events(restarted, "execute_accepted")

    outcomes = {outcome for _, _, outcome, _ in stream.results}
    assert outcomes <= {"OK", "UNAVAILABLE"}, outcomes
    answered_by = {}
    for worker in (victim, survivor, restarted):
        for request_id in log_events(worker, "execute", "OK"):
            assert request_id not in answered_by, f"{request_id} answered twice"
            answered_by[request_id] = worker.name
    victim_accepted = set(log_events(victim, "execute_accepted"))
    for request_id, _sent, outcome, answers in stream.results:
        if outcome == "OK":
            assert same_answers(answers, reference), request_id
            assert request_id in answered_by, f"{request_id} answered without a worker logging it"
        else:
            # Only a request the dead worker had accepted may fail; one that never reached it
            # was retried on the survivor.
            assert request_id in victim_accepted, f"{request_id} failed though no worker had taken it"
            # Never run elsewhere; the victim may have logged it OK just before the kill, the
            # answer not yet sent (seen under load).
            assert answered_by.get(request_id) in (None, victim.name), request_id
    assert stream.ok_since(killed_at) >= 6


def described(address: str) -> tuple[str, str, int]:
    """What DescribeModel takes from the workers: checkpoint revision, backend, default policy."""
    with grpc.insecure_channel(address) as channel:
        d = decision_pb2_grpc.DecisionServiceStub(channel).DescribeModel(api.DescribeModelRequest(), timeout=10)
    return d.checkpoint_revision, d.backend, d.default_prefix_policy


def refusal(address: str, body: dict = EXAMPLE) -> grpc.RpcError | None:
    with Client(address) as c:
        try:
            c.decide(body, timeout=30)
        except grpc.RpcError as error:
            return error
    return None


def refused_with(address: str, code: grpc.StatusCode) -> bool:
    error = refusal(address)
    return error is not None and error.code() == code


def test_an_incompatible_worker_is_named_and_never_described_as_this_model(demo_model, tmp_path):
    """Among several workers the refusal names the wrong one; DescribeModel keeps the compatible
    workers' description while the wrong one is there and after it is gone (it reported the other
    model's checkpoint under this frontend's model id, also once that worker had died)."""
    good = start_worker(demo_model, tmp_path, launch.free_port(), "good")
    wrong_port, metrics_port = launch.free_port(), launch.free_port()
    frontend = launch.start_frontend(
        demo_model,
        f"{good.address},127.0.0.1:{wrong_port}",
        tmp_path,
        ["--worker-refresh-seconds", "0.5", "--worker-affinity", "off", "--metrics-port", str(metrics_port)],
    )

    def serving_gauge() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        return next(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("openjev_frontend_workers_serving ")
        )

    wrong = None
    try:
        launch.wait_serving(frontend.address)
        before = described(frontend.address)
        assert before[0] != "another-revision" and before[1]
        wrong = start_worker(
            other_export(
                demo_model, tmp_path / "other", model_id="open-jev-other", checkpoint_revision="another-revision"
            ),
            tmp_path,
            wrong_port,
            "wrong",
        )
        failed = grpc.StatusCode.FAILED_PRECONDITION
        wait_for(lambda: refused_with(frontend.address, failed), 30, "the frontend to refuse the wrong worker")
        error = refusal(frontend.address)
        assert error is not None and error.details() == (
            f"worker at 127.0.0.1:{wrong_port} serves model 'open-jev-other', not this frontend's 'open-jev-demo'"
        )
        assert described(frontend.address) == before
        # requests may go to no worker while one is wrong: the gauge alerts watch says 0 (it said 1)
        wait_for(lambda: serving_gauge() == 0, 10, "the serving gauge to say no worker takes traffic")
        good.kill()
        wrong.kill()
        unavailable = grpc.StatusCode.UNAVAILABLE
        wait_for(lambda: refused_with(frontend.address, unavailable), 30, "the frontend to see both workers gone")
        assert described(frontend.address) == before
    finally:
        for process in (frontend, good, *([wrong] if wrong else [])):
            process.stop(timeout_seconds=10)


def test_workers_of_two_checkpoints_under_one_model_id_are_refused(demo_model, tmp_path):
    """Two workers with the same model id, tokenizer and temperature but another checkpoint (a
    retrained head) were balanced between: the same request alternated between two answers.
    Workers of one checkpoint serve, also one other than the frontend's export (a benchmark's
    synthetic weights)."""
    ports = [launch.free_port(), launch.free_port()]
    retrained = other_export(demo_model, tmp_path / "retrained", checkpoint_revision="retrained")
    workers = [
        start_worker(demo_model, tmp_path, ports[0], "first"),
        start_worker(retrained, tmp_path, ports[1], "retrained"),
    ]
    frontend = launch.start_frontend(
        demo_model, ",".join(w.address for w in workers), tmp_path, ["--worker-refresh-seconds", "0.5"]
    )
    try:
        failed = grpc.StatusCode.FAILED_PRECONDITION
        wait_for(lambda: refused_with(frontend.address, failed), 30, "the frontend to refuse the two checkpoints")
        error = refusal(frontend.address)
        revision = json.loads((demo_model / "open_jev_export.json").read_text())["checkpoint_revision"]
        named = sorted([(f"127.0.0.1:{ports[0]}", revision), (f"127.0.0.1:{ports[1]}", "retrained")])
        assert error is not None and error.details() == (
            f"workers at {frontend_target(workers)} serve different checkpoint revisions: "
            + ", ".join(f"{endpoint} {rev!r}" for endpoint, rev in named)
        )
        workers[0].stop(timeout_seconds=10)
        wait_for(lambda: refusal(frontend.address) is None, 30, "the frontend to serve the one checkpoint left")
    finally:
        for process in (frontend, *workers):
            process.stop(timeout_seconds=10)


def test_another_checkpoint_is_not_served_while_a_worker_of_the_fleet_is_away(demo_model, tmp_path):
    """One worker of two killed, the other restarted with another checkpoint: it alone was the
    fleet, and its answers were served in the model's name, until the first came back and the
    fleet disagreed (a review helper's finding). Now the frontend refuses, naming the worker it
    waits for; once every worker answers with the new checkpoint, it serves that."""
    ports = [launch.free_port(), launch.free_port()]
    retrained = other_export(demo_model, tmp_path / "retrained", checkpoint_revision="retrained")
    workers = [start_worker(demo_model, tmp_path, port, f"w{i}") for i, port in enumerate(ports)]
    frontend = launch.start_frontend(
        demo_model, frontend_target(workers), tmp_path, ["--worker-refresh-seconds", "0.5", "--worker-affinity", "off"]
    )
    later: list[launch.Process] = []
    try:
        launch.wait_serving(frontend.address)
        workers[0].popen.kill()
        workers[1].stop(timeout_seconds=10)
        later.append(start_worker(retrained, tmp_path, ports[1], "retrained-1"))
        failed = grpc.StatusCode.FAILED_PRECONDITION
        wait_for(lambda: refused_with(frontend.address, failed), 30, "the frontend to refuse the lone new checkpoint")
        time.sleep(1.5)  # several descriptions later: still refused
        error = refusal(frontend.address)
        assert error is not None and error.code() == failed, error
        assert f"127.0.0.1:{ports[0]} cannot be reached" in error.details(), error.details()
        assert log_events(later[0], "execute", "OK") == []  # it answered nothing in the fleet's name
        later.append(start_worker(retrained, tmp_path, ports[0], "retrained-0"))
        wait_for(lambda: refusal(frontend.address) is None, 30, "the frontend to serve the new checkpoint")
    finally:
        for process in (frontend, *workers, *later):
            process.stop(timeout_seconds=10)


def test_a_fleet_refusal_ends_soon_after_its_cause_is_gone(demo_model, tmp_path):
    """Two checkpoints, then the other one stopped: the refusal lasted until the next periodic
    description (here 30 s); while refused the frontend describes its workers every second."""
    ports = [launch.free_port(), launch.free_port()]
    retrained = other_export(demo_model, tmp_path / "retrained", checkpoint_revision="retrained")
    workers = [start_worker(demo_model, tmp_path, ports[0], "first"), start_worker(retrained, tmp_path, ports[1], "r")]
    frontend = launch.start_frontend(
        demo_model, frontend_target(workers), tmp_path, ["--worker-refresh-seconds", "30", "--worker-affinity", "off"]
    )
    try:
        failed = grpc.StatusCode.FAILED_PRECONDITION
        wait_for(lambda: refused_with(frontend.address, failed), 60, "the frontend to refuse the two checkpoints")
        workers[1].stop(timeout_seconds=10)
        stopped = time.monotonic()
        wait_for(lambda: refusal(frontend.address) is None, 15, "the frontend to serve the one checkpoint left")
        assert time.monotonic() - stopped < 15
    finally:
        for process in (frontend, *workers):
            process.stop(timeout_seconds=10)


def test_workers_of_two_heads_under_one_revision_are_refused(demo_model, tmp_path):
    """Two workers of one model id, tokenizer, temperature and revision but another head: the
    frontend balanced between them and the same request alternated between two answers (a
    review helper's finding). Describe now carries a digest of the parsed config and the head."""
    ports = [launch.free_port(), launch.free_port()]
    other = other_export(demo_model, tmp_path / "head", head_bias=3.0)
    workers = [start_worker(demo_model, tmp_path, ports[0], "first"), start_worker(other, tmp_path, ports[1], "head")]
    frontend = launch.start_frontend(
        demo_model, frontend_target(workers), tmp_path, ["--worker-refresh-seconds", "0.5"]
    )
    try:
        failed = grpc.StatusCode.FAILED_PRECONDITION
        wait_for(lambda: refused_with(frontend.address, failed), 30, "the frontend to refuse the two heads")
        error = refusal(frontend.address)
        assert error is not None
        assert (
            f"workers at {frontend_target(workers)} serve different weights (config.json or head) under one revision: "
            in (error.details())
        )
        workers[1].stop(timeout_seconds=10)
        wait_for(lambda: refusal(frontend.address) is None, 30, "the frontend to serve the one head left")
    finally:
        for process in (frontend, *workers):
            process.stop(timeout_seconds=10)


def frontend_target(workers) -> str:
    return ",".join(w.address for w in workers)


class NotAWorker:
    """Some other gRPC server on a worker's address (a reused address, another server's port):
    its health says SERVING, and it serves neither Describe nor Execute."""

    def __init__(self, port: int):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health = grpc_health.HealthServicer()
        health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def stop(self, timeout_seconds: float) -> None:
        self.server.stop(0)


# How the second worker comes back between two descriptions, and how the frontend then refuses.
RESTARTS = {
    "fewer candidates allowed": (
        lambda export, tmp: (export, ["--max-candidates", "4"]),
        "accepts at most 4 candidates per request",
    ),
    # a retrained head under the same model id: its answers differ from the first worker's
    "another checkpoint": (
        lambda export, tmp: (other_export(export, tmp / "retrained", checkpoint_revision="retrained"), []),
        "serve different checkpoint revisions",
    ),
    "another default policy": (
        lambda export, tmp: (export, ["--prefix-policy", "off"]),
        "have different default prefix policies",
    ),
    # another head under the same revision (an export relabelled wrongly): its answers differ too
    "another head, one revision": (
        lambda export, tmp: (other_export(export, tmp / "head", head_bias=3.0), []),
        "serve different weights (config.json or head) under one revision",
    ),
    "not a worker": (None, "is not an Open-Jev worker (Describe is UNIMPLEMENTED)"),
}


@pytest.mark.parametrize("restart", list(RESTARTS))
def test_a_worker_restarted_otherwise_is_found_at_its_first_refusal(demo_model, tmp_path, restart):
    """Between two descriptions (here 10 minutes apart) the second worker's address comes back as
    another worker. With fewer candidates allowed it refused what the frontend had checked, and
    every request it drew failed INTERNAL; with another checkpoint or default policy it answered
    the same request otherwise than the first worker; something other than a worker failed them
    INTERNAL. Each now refuses such calls before accepting them (nothing ran), so they go to
    the first worker and have the workers described at once: requests are answered by the first
    worker until the frontend refuses them all, naming the problem."""
    make, problem = RESTARTS[restart]
    ports = [launch.free_port(), launch.free_port()]
    workers = [start_worker(demo_model, tmp_path, port, f"w{i}") for i, port in enumerate(ports)]
    frontend = launch.start_frontend(
        demo_model,
        ",".join(w.address for w in workers),
        tmp_path,
        ["--worker-refresh-seconds", "600", "--worker-affinity", "off"],
    )
    replaced = None
    try:
        launch.wait_serving(frontend.address)
        workers[1].stop(timeout_seconds=10)
        if make is None:
            replaced = NotAWorker(ports[1])
        else:
            export, args = make(demo_model, tmp_path)
            listen = ["--listen", f"127.0.0.1:{ports[1]}"]
            replaced = launch.start_worker(export, tmp_path, [*listen, *WORKER_ARGS, *args], name="replaced")
        codes: list[str] = []
        deadline = time.monotonic() + 30
        while not codes or codes[-1] != "FAILED_PRECONDITION":  # once a call reached the new one
            assert time.monotonic() < deadline, codes
            error = refusal(frontend.address, SIX)
            codes.append("OK" if error is None else error.code().name)
            assert "INTERNAL" not in codes, (codes, error and error.details())
            time.sleep(0.2)
        assert error is not None and problem in error.details(), error.details()
        if isinstance(replaced, launch.Process):  # it answered none of them
            assert log_events(replaced, "execute", "OK") == []
    finally:
        for process in (frontend, workers[0], *([replaced] if replaced else [])):
            process.stop(timeout_seconds=10)


SIX = {
    "state": "A customer writes in.",
    "questions": {"q": {"type": "choice", "instructions": "Pick.", "criteria": {f"k{i}": None for i in range(6)}}},
}


@pytest.mark.parametrize(
    ("worker", "env", "why"),
    [
        # a DNS server: was mangled into dns://///10.0.0.2/...
        ("dns://10.0.0.2/worker:50052", {}, "a DNS server (dns://AUTHORITY/) is not supported"),
        ("DNS:///worker:50052", {}, "'DNS:///worker' is not a host name"),  # was taken for a host name
        ("127.0.0.1:99999", {}, "is not HOST:PORT (a port 1-65535)"),
        ("127.0.0.1:0", {}, "is not HOST:PORT (a port 1-65535)"),
        (None, {"OPENJEV_WORKER": "worker/a:50052"}, "'worker/a' is not a host name"),
        ("dns:///worker..openjev:50052", {}, "'worker..openjev' is not a host name"),  # an empty label: a traceback
        (f"dns:///{'w' * 64}.openjev:50052", {}, ".openjev' is not a host name"),  # a label over 63 characters
    ],
)
def test_a_bad_worker_target_is_a_one_line_error(demo_model, worker, env, why):
    """Like every other bad flag: one line, exit 2, nothing served (they were accepted and never served)."""
    args = ["--model", str(demo_model), "--plaintext", "--listen", "127.0.0.1:0"]
    done = subprocess.run(
        [sys.executable, "-m", launch.FRONTEND_MODULE, *args, *(["--worker", worker] if worker else [])],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "error:" in lines[0] and ("--worker" in lines[0] or "OPENJEV_WORKER" in lines[0]), lines
    assert why in lines[0], lines
