"""SIGTERM on a real frontend under load: the requests in flight finish, new ones are refused,
and the process exits within its grace period."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from openjev.client import Client
from openjev.tools import launch
from openjev.tools.soak import log_events

# ~64,000 tokens computed one prompt after another: many seconds on a CPU
SLOW = {
    "state": "A customer message that goes on. " * 250,
    "questions": {"q": {"type": "choice", "instructions": "Pick.", "criteria": {f"o{i}": None for i in range(32)}}},
}
GRACE_SECONDS = 10
# About half a second each on CI's CPU; the worker runs them one after another.
REQUEST = {
    "state": "A customer message that goes on. " * 20,
    "questions": {
        "q": {"type": "choice", "instructions": "Pick one.", "criteria": {f"option {i}": None for i in range(8)}}
    },
}


def in_flight(url: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "openjev_frontend_in_flight_requests":
                return sample.value
    raise AssertionError("no in-flight gauge")


def test_sigterm_drains_in_flight_and_refuses_new(demo_model, tmp_path):
    metrics_port = launch.free_port()
    worker = launch.start_worker(demo_model, tmp_path)
    frontend = launch.start_frontend(
        demo_model,
        worker.address,
        tmp_path,
        # link refreshes during the drain too: they must not turn health back to SERVING
        ["--grace-seconds", str(GRACE_SECONDS), "--metrics-port", str(metrics_port), "--worker-refresh-seconds", "0.3"],
    )
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    watched: list[int] = []  # health statuses seen on a Watch stream
    try:
        launch.wait_serving(frontend.address)
        watcher = threading.Thread(target=_watch_health, args=(frontend.address, watched), daemon=True)
        watcher.start()
        deadline = time.monotonic() + 30
        while not watched:  # the Watch stream is open (its first status came) before the signal
            assert time.monotonic() < deadline, "no health status on the Watch stream"
            time.sleep(0.02)
        with Client(frontend.address) as c, futures.ThreadPoolExecutor(4) as pool:

            def call(i: int):
                response = c.decide(REQUEST, policy="off", timeout=60, request_id=f"drain-{i}")
                return response, time.monotonic()

            calls = [pool.submit(call, i) for i in range(4)]
            deadline = time.monotonic() + 30
            while in_flight(url) < 4:
                assert time.monotonic() < deadline, "requests never got in flight"
                time.sleep(0.02)
            frontend.popen.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            while '"event": "draining"' not in frontend.log_text():  # logged once stop() refuses new calls
                assert time.monotonic() < signalled + 5, "SIGTERM was not handled"
                time.sleep(0.02)
            # a new client on a connection of its own (channels of one process share connections
            # otherwise: a call on one the server has not yet sent its GOAWAY on waits out the grace
            # period and ends CANCELLED, gRPC's behaviour, docs/deploy.md "Shutdown")
            own_connection = [("grpc.use_local_subchannel_pool", 1)]
            with Client(frontend.address, options=own_connection) as late, pytest.raises(grpc.RpcError) as refused:
                late.decide(REQUEST, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            results = [call.result(timeout=60) for call in calls]  # none failed
            assert all(list(response["answers"]) == ["q"] for response, _ in results)
            assert max(done for _, done in results) > signalled + 0.3, "nothing was still in flight"
        frontend.popen.wait(timeout=GRACE_SECONDS + 5)
        assert frontend.popen.returncode == 0
        assert time.monotonic() - signalled < GRACE_SECONDS + 3
        assert '"event": "shutdown"' in frontend.log_text()
        watcher.join(10)
        # the Watch stream saw SERVING, then NOT_SERVING at the signal, and nothing after it
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        assert serving in watched and watched[-1] == not_serving, watched
        assert serving not in watched[watched.index(not_serving, watched.index(serving)) :], watched
    finally:
        frontend.stop()
        worker.stop()


def test_an_idle_server_with_an_open_health_watch_stops_at_once(demo_model, tmp_path):
    """Nothing in flight but a client's health Watch stream: the stream gets NOT_SERVING and
    ends, and the frontend exits at once. It stayed open, and the server's stop counted it as a
    call in flight, so every SIGTERM waited the whole grace period (a review helper's finding)."""
    worker = launch.start_worker(demo_model, tmp_path)
    frontend = launch.start_frontend(demo_model, worker.address, tmp_path, ["--grace-seconds", str(GRACE_SECONDS)])
    watched: list[int] = []
    try:
        launch.wait_serving(frontend.address)
        watcher = threading.Thread(target=_watch_health, args=(frontend.address, watched), daemon=True)
        watcher.start()
        deadline = time.monotonic() + 30
        while not watched:
            assert time.monotonic() < deadline, "no health status on the Watch stream"
            time.sleep(0.02)
        signalled = time.monotonic()
        frontend.popen.send_signal(signal.SIGTERM)
        frontend.popen.wait(timeout=GRACE_SECONDS + 5)
        assert frontend.popen.returncode == 0
        assert time.monotonic() - signalled < 3, f"an idle frontend took {time.monotonic() - signalled:.1f} s"
        watcher.join(5)
        assert watched[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, watched
    finally:
        frontend.stop()
        worker.stop()


def _watch_health(address: str, into: list[int]) -> None:
    with grpc.insecure_channel(address) as channel:
        try:
            for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="")):
                into.append(reply.status)
        except grpc.RpcError:
            pass  # the server stopped


def test_sigterm_while_the_worker_starts_exits_at_once(demo_model, tmp_path):
    """Before SERVING there is nothing to drain: SIGTERM ends the worker with status 0 (its own
    handler; a process without one dies of the signal, and as a container's PID 1 it would not
    see it at all) and a `shutdown` line saying so."""
    import subprocess
    import sys

    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            launch.WORKER_MODULE,
            "--model",
            str(demo_model),
            "--listen",
            "127.0.0.1:0",
            "--plaintext",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert worker.stderr is not None
    lines = []
    for line in worker.stderr:  # the config line comes first, long before weights are warm
        lines.append(line)
        if '"event": "config"' in line:
            break
    signalled = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    try:
        _, rest = worker.communicate(timeout=60)
    finally:
        worker.kill()
    lines += rest.splitlines()
    assert worker.returncode == 0, lines
    assert time.monotonic() - signalled < 20, lines  # seconds at most: the main thread is back in Python
    assert any('"event": "shutdown"' in line and "start-up" in line for line in lines), lines
    assert not any('"event": "serving"' in line for line in lines), lines


def test_sigterm_while_starting_never_waits_on_the_loggers_lock(tmp_path):
    """The start-up handler only raises: the main thread may be inside the logger, holding its
    (non-reentrant) lock, when the signal comes, and a handler that logged there hung for good
    (2 of 3 runs of this loop; once in the test suite)."""
    import subprocess
    import sys

    script = tmp_path / "busy.py"
    script.write_text(
        "import sys\n"
        "from openjev import logs, serving\n"
        "logs.configure('info')\n"
        "log = logs.get('busy')\n"
        "with serving.exit_on_signal_while_starting('busy'):\n"
        "    print('ready', flush=True)\n"
        "    while True:\n"
        "        log.info('busy', padding='x' * 200)\n"
    )
    for _ in range(3):
        busy = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert busy.stdout is not None and busy.stdout.readline() == "ready\n"
        time.sleep(0.3)
        busy.send_signal(signal.SIGTERM)
        try:
            _, err = busy.communicate(timeout=20)
        finally:
            busy.kill()
        assert busy.returncode == 0
        assert '"event": "shutdown"' in err.splitlines()[-1]


def _starting(tmp_path, body: str) -> subprocess.Popen:
    script = tmp_path / "starting.py"
    script.write_text(
        "import os, signal, time\n"
        "from openjev import logs, serving\n"
        "logs.configure('info')\n"
        "with serving.exit_on_signal_while_starting('starting'):\n" + body
    )
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# A SIGTERM whose exception is swallowed where it lands, as a native module's init may
SWALLOWED = (
    "    try:\n"
    "        os.kill(os.getpid(), signal.SIGTERM)\n"
    "        time.sleep(1)\n"
    "    except BaseException:\n"
    "        pass\n"
)


def test_a_start_up_signal_whose_exception_was_swallowed_still_stops_before_serving(tmp_path):
    """The handler's exception can land where native code swallows it (a review saw 5 worker
    starts in ~20 lose a SIGTERM inside `import torch`, then serve on): the flag it also sets
    stops start-up at the check before SERVING."""
    starting = _starting(
        tmp_path, SWALLOWED + "    serving.stop_if_signalled_while_starting()\n    print('serving', flush=True)\n"
    )
    out, err = starting.communicate(timeout=60)
    assert starting.returncode == 0 and "serving" not in out, (out, err)
    assert '"event": "shutdown"' in err and "start-up" in err, err


def test_a_failure_after_a_swallowed_start_up_signal_is_the_stop_not_a_traceback(tmp_path):
    """numpy's import, cut short by the handler's exception, failed on its next import ("cannot
    load module more than once per process"): a traceback and exit 1 for a plain SIGTERM."""
    starting = _starting(
        tmp_path, SWALLOWED + "    raise ImportError('cannot load module more than once per process')\n"
    )
    _, err = starting.communicate(timeout=60)
    assert starting.returncode == 0 and "Traceback" not in err, err
    assert '"event": "shutdown"' in err and "start-up" in err, err


def test_sigint_while_starting_is_a_shutdown_line_not_a_traceback(tmp_path):
    """Ctrl-C during start-up printed a KeyboardInterrupt traceback and exited -2."""
    starting = _starting(tmp_path, "    print('ready', flush=True)\n    while True:\n        time.sleep(0.01)\n")
    assert starting.stdout is not None and starting.stdout.readline() == "ready\n"
    starting.send_signal(signal.SIGINT)
    try:
        _, err = starting.communicate(timeout=20)
    finally:
        starting.kill()
    assert starting.returncode == 0 and "Traceback" not in err, err
    assert '"event": "shutdown"' in err and "start-up" in err, err


def test_a_worker_call_cut_off_by_the_worker_grace_period_is_logged_as_the_servers(demo_model, tmp_path):
    """A request still running on a worker when its grace period ends: the worker's `execute`
    line says SERVER_SHUTDOWN, as its metrics do (it said CANCELLED, "request cancelled before it
    finished": a client's cancel; a review helper's finding)."""
    pair = launch.start_pair(demo_model, tmp_path, worker_args=["--grace-seconds", "1", "--log-level", "debug"])
    try:
        with Client(pair.frontend.address) as c, futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(c.decide, SLOW, policy="off", timeout=120, request_id="cut-worker")
            deadline = time.monotonic() + 30
            while '"execute_started"' not in pair.worker.log_text():
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.02)
            pair.worker.popen.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError):
                call.result(timeout=60)
        pair.worker.popen.wait(timeout=15)
        (line,) = [e for e in log_events(pair.worker.log_text(), "execute") if e.get("request_id") == "cut-worker"]
        assert line["outcome"] == "SERVER_SHUTDOWN", line
    finally:
        pair.stop()


def test_a_queued_call_cut_off_by_the_worker_grace_period_does_not_blame_the_client(demo_model, tmp_path):
    """A request still queued behind another when the worker's grace period ends: its `execute`
    line says SERVER_SHUTDOWN and a reason that does not name the client (it said "client went
    away while queued" beside SERVER_SHUTDOWN; a review helper's finding)."""
    worker_args = ["--grace-seconds", "1", "--log-level", "debug", "--max-launch-sequences", "1"]
    pair = launch.start_pair(demo_model, tmp_path, worker_args=[*worker_args, "--state-cache-bytes", "0"])
    try:
        with Client(pair.frontend.address) as c, futures.ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(c.decide, SLOW, policy="off", timeout=120, request_id="run")]
            deadline = time.monotonic() + 30
            while '"execute_started"' not in pair.worker.log_text():
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.02)
            calls.append(pool.submit(c.decide, SLOW, policy="off", timeout=120, request_id="queued"))
            while '"queued"' not in pair.worker.log_text():  # its execute_accepted line
                assert time.monotonic() < deadline, "the second request never reached the worker"
                time.sleep(0.02)
            time.sleep(0.3)  # admitted behind the first (one sequence a pass)
            pair.worker.popen.send_signal(signal.SIGTERM)
            for call in calls:
                with pytest.raises(grpc.RpcError):
                    call.result(timeout=60)
        pair.worker.popen.wait(timeout=15)
        (line,) = [e for e in log_events(pair.worker.log_text(), "execute") if e.get("request_id") == "queued"]
        assert line["outcome"] == "SERVER_SHUTDOWN" and line["reason"] == "cancelled while queued", line
    finally:
        pair.stop()


def test_a_request_cut_off_by_the_grace_period_counts_as_the_servers(demo_model, tmp_path):
    """A request still running when the frontend's grace period ends is ended by the server: its
    log line and metrics say SERVER_SHUTDOWN (they said CLIENT_CANCELLED, which alerts leave out,
    so requests lost in a restart went unseen)."""
    worker = launch.start_worker(demo_model, tmp_path, ["--log-level", "debug"])  # logs execute_started
    frontend = launch.start_frontend(demo_model, worker.address, tmp_path, ["--grace-seconds", "1"])
    try:
        launch.wait_serving(frontend.address)
        with Client(frontend.address) as c, futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(c.decide, SLOW, policy="off", timeout=120, request_id="cut-off")
            deadline = time.monotonic() + 30
            while '"execute_started"' not in worker.log_text():
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.02)
            frontend.popen.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as cut:
                call.result(timeout=60)
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        frontend.popen.wait(timeout=15)
        lines = [line for line in frontend.log_text().splitlines() if '"cut-off"' in line and '"decide"' in line]
        assert lines and '"outcome": "SERVER_SHUTDOWN"' in lines[-1], lines
    finally:
        frontend.stop()
        worker.stop()
