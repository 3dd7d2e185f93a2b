"""A dead or silent worker ends every in-flight request within a bound, and the frontend's
in-flight gauge returns to zero. Clients here set no deadline: the frontend's own cap
(--worker-deadline-seconds) is what bounds them.

Seen before: after `kill -9` of the worker one request stayed blocked until the client's own
60 s deadline and `in_flight_requests` stayed at 1 until the frontend restarted. The cause: gRPC's
own retries (grpcio 1.84) of a worker call the worker had not yet accepted delivered the retry's
failure status but never completed the call's pending receive operations, so grpcio's response
iterator waited for good, deaf to the deadline and to cancel(). Requests refused part-way through
tokenizing (over the token limit) are such calls for longest, hence the second test."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from openjev.client import Client
from openjev.tools import launch
from openjev.tools.soak import log_events, outcome_counts
from openjev.v1 import decision_pb2 as api

CAP_SECONDS = 6.0
BOUND_SECONDS = CAP_SECONDS + 4.0  # the cap plus reconnect and scheduling slack
MEDIUM = {
    "state": "word " * 600,
    "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(6)}}},
}
ENDED = {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}
TOKEN_LIMIT = 32768
# About 1,030 tokens a candidate: the token limit is passed after the second batch of 16, so the
# worker call is open, never committed, for as long as the first batches take to tokenize.
OVER_TOKEN_LIMIT = {
    "state": "word " * 1000,
    "questions": {
        "q": {
            "type": "choice",
            "instructions": "pick",
            "criteria": {str(i): None for i in range(TOKEN_LIMIT // 1000 + 8)},
        }
    },
}


def in_flight(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    line = next(x for x in text.splitlines() if x.startswith("openjev_frontend_in_flight_requests "))
    return float(line.split()[1])


def stop_process(pid: int) -> None:
    """SIGSTOP, and wait until every thread of the process is stopped: kill() returns before they
    stop, and on loaded cores a worker once accepted a request sent after it, then hung with it."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not all(map(_stopped, Path(f"/proc/{pid}/task").glob("*/stat"))):
        assert time.monotonic() < deadline, "the worker did not stop"
        time.sleep(0.01)
    os.kill(pid, 0)  # still there (stopped, not gone)


def _stopped(stat: Path) -> bool:
    """A thread's state is stopped, or the thread is gone (it exited while we looked)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] in "TtZX"
    except OSError:
        return True


def _load(address: str, stop: threading.Event, outcomes: list) -> None:
    body = api.DecideRequest(request_json=json.dumps(MEDIUM), prefix_policy=api.PREFIX_POLICY_OFF)
    with Client(address) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                client.stub.Decide(body)  # no deadline
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
            outcomes.append((code, time.monotonic() - started))


def _start_pair(demo_model, tmp_path, worker_extra: list[str], frontend_extra: list[str]):
    """A worker on a known port (the tests restart it there with the same arguments) and a frontend
    that probes it every 0.5 s and caps its calls at CAP_SECONDS: (worker arguments, metrics port,
    worker, frontend)."""
    port, metrics_port = launch.free_port(), launch.free_port()
    worker_args = ["--listen", f"127.0.0.1:{port}", *worker_extra]
    worker = launch.start_worker(demo_model, tmp_path, worker_args)
    frontend_args = ["--worker-refresh-seconds", "0.5", "--worker-deadline-seconds", str(CAP_SECONDS)]
    frontend = launch.start_frontend(
        demo_model, worker.address, tmp_path, [*frontend_args, *frontend_extra, "--metrics-port", str(metrics_port)]
    )
    return worker_args, metrics_port, worker, frontend


def test_worker_killed_or_stopped_under_load_never_hangs_a_request(demo_model, tmp_path):
    worker_args, metrics_port, worker, frontend = _start_pair(demo_model, tmp_path, ["--max-launch-sequences", "1"], [])
    outcomes: list = []
    try:
        launch.wait_serving(frontend.address)
        for round_ in range(3):
            stop = threading.Event()
            clients = [threading.Thread(target=_load, args=(frontend.address, stop, outcomes)) for _ in range(6)]
            for thread in clients:
                thread.start()
            time.sleep(1.5)
            if round_ == 2:  # silent, not dead: the process stops answering but its socket stays open
                os.kill(worker.popen.pid, signal.SIGSTOP)
                time.sleep(BOUND_SECONDS)
                os.kill(worker.popen.pid, signal.SIGKILL)
            worker.kill()
            stop.set()
            for thread in clients:
                thread.join(BOUND_SECONDS + 5)
                assert not thread.is_alive(), "a request outlived its bound"
            worker = launch.start_worker(demo_model, tmp_path, worker_args, name=f"worker-{round_}")
            launch.wait_serving(frontend.address, timeout_seconds=30)
        assert outcomes
        assert {code for code, _ in outcomes} <= ENDED, outcomes
        assert max(seconds for _, seconds in outcomes) < BOUND_SECONDS, outcomes
        assert any(code != "OK" for code, _ in outcomes)
        deadline = time.monotonic() + 10
        while in_flight(metrics_port) != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert in_flight(metrics_port) == 0
        # The clients set no deadline, so each DEADLINE_EXCEEDED was the frontend's own cap (the
        # stopped worker): counted as a server-side outcome, never as a client's deadline.
        counted = outcome_counts(f"http://127.0.0.1:{metrics_port}/metrics", "openjev_frontend_request_seconds_count")
        timed_out = sum(code == "DEADLINE_EXCEEDED" for code, _ in outcomes)
        assert timed_out > 0 and counted.get("WORKER_DEADLINE_EXCEEDED") == timed_out, (counted, timed_out)
        assert "DEADLINE_EXCEEDED" not in counted, counted
    finally:
        frontend.stop()
        worker.stop()


def _refused_part_way(address: str, stop: threading.Event, sending: threading.Event, outcomes: list) -> None:
    body = api.DecideRequest(request_json=json.dumps(OVER_TOKEN_LIMIT))
    with Client(address) as client:
        while not stop.is_set():
            if not sending.wait(1.0):
                continue
            started = time.monotonic()
            try:
                client.stub.Decide(body)  # no deadline: the frontend's cap must bound it
                code, details = "OK", ""
            except grpc.RpcError as error:
                code, details = error.code().name, error.details() or ""
            outcomes.append((code, details, time.monotonic() - started))
            if code == "UNAVAILABLE":
                stop.wait(0.2)  # the worker is down: do not spin


def test_worker_killed_while_requests_are_refused_part_way_never_hangs_one(demo_model, tmp_path):
    """Over-limit requests (refused while tokenizing, their worker call never committed) in flight
    while the worker is killed, round after round: each ends within the frontend's cap, and the
    in-flight gauge returns to zero. Before the fix about one round in two left a request hung."""
    worker_args, metrics_port, worker, frontend = _start_pair(
        demo_model, tmp_path, [], ["--max-request-tokens", str(TOKEN_LIMIT)]
    )
    outcomes: list = []
    stop, sending = threading.Event(), threading.Event()
    clients = [
        threading.Thread(target=_refused_part_way, args=(frontend.address, stop, sending, outcomes), daemon=True)
        for _ in range(4)
    ]
    try:
        launch.wait_serving(frontend.address)
        for thread in clients:
            thread.start()
        for round_ in range(6):
            sending.set()
            time.sleep(1.0 + 0.37 * (round_ % 3))  # kills land at different points of the tokenizing
            worker.kill()
            # no new requests while the worker restarts: the ones in flight at the kill are the case,
            # and tokenizing more beside the restart only slowed it (half the test's CPU)
            sending.clear()
            time.sleep(0.5)
            worker = launch.start_worker(demo_model, tmp_path, worker_args, name=f"worker-{round_}")
            launch.wait_serving(frontend.address, timeout_seconds=30)
        sending.set()
        time.sleep(1.0)
        stop.set()
        for thread in clients:
            thread.join(BOUND_SECONDS + 5)
            assert not thread.is_alive(), "a request outlived its bound"
        assert {code for code, _, _ in outcomes} <= {"INVALID_ARGUMENT", "UNAVAILABLE", "DEADLINE_EXCEEDED"}, outcomes
        assert {details for code, details, _ in outcomes if code == "INVALID_ARGUMENT"} == {
            "request exceeds the token limit"
        }
        assert sum(code == "INVALID_ARGUMENT" for code, _, _ in outcomes) >= 6, outcomes
        # a kill that lands while a request is tokenized fails its worker call: the contract's
        # refusal is still the answer, and its log line keeps the worker's status
        lines = log_events(frontend.log_text(), "decide")
        assert any("worker_status" in line for line in lines), "no kill landed on a request in flight"
        assert max(seconds for _, _, seconds in outcomes) < BOUND_SECONDS, outcomes
        deadline = time.monotonic() + 10
        while in_flight(metrics_port) != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert in_flight(metrics_port) == 0
    finally:
        stop.set()
        frontend.stop()
        worker.stop()


def test_a_retry_on_a_stopped_worker_waits_only_the_connect_bound(demo_model, tmp_path):
    """A call on a worker that stopped answering fails at the keepalive (10 s pings, 5 s to
    answer), unaccepted, and the frontend tries it again: that retry's new connection waited
    another keepalive cycle (20-29 s in all). A connection that gets no SETTINGS frame now fails
    within routing.CONNECT_TIMEOUT_MS (3 s)."""
    worker = launch.start_worker(demo_model, tmp_path, [])
    frontend = launch.start_frontend(demo_model, worker.address, tmp_path, ["--log-level", "debug"])
    try:
        launch.wait_serving(frontend.address)
        with Client(frontend.address) as client:
            client.decide(MEDIUM, timeout=30)  # connected and warm
            stop_process(worker.popen.pid)
            with pytest.raises(grpc.RpcError) as caught:
                client.decide(MEDIUM, request_id="stopped", timeout=60)
        ended = time.time()
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
        retries = [e for e in log_events(frontend.log_text(), "worker_retry") if e.get("request_id") == "stopped"]
        assert retries and "ping timeout" in retries[0]["reason"], retries
        first_retry = datetime.fromisoformat(retries[0]["timestamp"]).timestamp()
        assert ended - first_retry < 10, f"the retries took {ended - first_retry:.1f} s"  # 15 s before
    finally:
        os.kill(worker.popen.pid, signal.SIGCONT)
        frontend.stop()
        worker.stop()
