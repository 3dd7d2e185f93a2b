"""`--worker dns:///NAME:PORT` whose addresses change while the frontend runs, all real servers on
loopback. The frontend runs in a mount namespace of its own where /etc/hosts is a file this test
writes (`unshare`; skipped where that is not allowed), so both its probes (getaddrinfo) and gRPC's
resolver see the name change. gRPC re-resolves a channel's name only when a connection drops (at
most every 30 s, backing off while the name fails): a name that resolved late served 30 s later,
and a worker added to the name got no traffic for 75 s while the frontend reported it ok."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import pytest

from openjev.client import Client
from openjev.tools import launch
from openjev.tools.soak import log_events

WORKER_ARGS = ["--log-level", "debug", "--grace-seconds", "2"]
# Long enough (seconds on two CPU cores) to be still running when the frontend's channels change.
SLOW = {
    "state": "A long customer message. " * 400,
    "questions": {
        "q": {"type": "choice", "instructions": "Pick one.", "criteria": {f"option {i}": None for i in range(24)}}
    },
}


def noul(state: str) -> dict:
    return {"state": state, "questions": {"q": {"type": "noul", "instructions": "Is it late?"}}}


def in_namespace(tmp_path: Path, hosts: Path) -> Path:
    """An interpreter that runs with `hosts` as its /etc/hosts (skips the test where it cannot)."""
    unshare = [
        "unshare",
        "-r",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount --bind "$0" /etc/hosts && exec "$@"',
    ]
    if shutil.which("unshare") is None or subprocess.run([*unshare, str(hosts), "true"]).returncode != 0:
        pytest.skip("needs unshare -r -m (user and mount namespaces) to give the frontend its own /etc/hosts")
    wrapper = tmp_path / "python-with-hosts"
    script = " ".join(f"'{part}'" for part in unshare)
    wrapper.write_text(f'#!/bin/sh\nexec {script} "{hosts}" "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def answered(worker: launch.Process) -> set[str]:
    return {e.get("request_id") for e in log_events(worker.log_text(), "execute") if e.get("status") == "OK"}


def test_a_name_that_resolves_late_moves_or_gains_a_worker_is_followed(demo_model, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    python = in_namespace(tmp_path, hosts)
    port = launch.free_port()
    processes = []
    try:
        first = launch.start_worker(demo_model, tmp_path, [*WORKER_ARGS, "--listen", f"127.0.0.1:{port}"], name="first")
        processes.append(first)
        frontend = launch.start(
            "frontend",
            launch.FRONTEND_MODULE,
            ["--model", str(demo_model), "--worker", f"dns:///wk:{port}", "--plaintext"]
            + ["--worker-refresh-seconds", "0.5", "--log-level", "debug"],
            workdir=tmp_path,
            python=python,
        )
        processes.append(frontend)
        time.sleep(2)
        # The name appears, at an address where no worker listens (a pod replaced meanwhile):
        # gRPC's channel fails to connect and may ask its resolver again only 30 s after this.
        hosts.write_text("127.0.0.1 localhost\n127.0.0.3 wk\n")  # in place: the bind mount shows it
        time.sleep(3)
        hosts.write_text("127.0.0.1 localhost\n127.0.0.1 wk\n")
        started = time.monotonic()
        launch.wait_serving(frontend.address, timeout_seconds=10)
        print(f"serving {time.monotonic() - started:.1f} s after the name moved to the worker")

        second = launch.start(
            "second",
            launch.WORKER_MODULE,
            ["--model", str(demo_model), "--plaintext", *WORKER_ARGS, "--listen", f"127.0.0.2:{port}"],
            workdir=tmp_path,
        )
        processes.append(second)
        launch.wait_serving(f"127.0.0.2:{port}")
        # Requests are sent without waiting for their answers: one round-robined to the first
        # worker waits there behind the slow one (over 10 s on CI's two loaded cores).
        with Client(frontend.address) as c, futures.ThreadPoolExecutor(64) as pool:
            slow = pool.submit(c.decide, SLOW, policy="off", request_id="slow", timeout=120)
            deadline = time.monotonic() + 30
            while "slow" not in {e.get("request_id") for e in log_events(first.log_text(), "execute_accepted")}:
                assert time.monotonic() < deadline, "the slow request was not accepted"
                time.sleep(0.05)
            with open(hosts, "a") as f:
                f.write("127.0.0.2 wk\n")
            started = time.monotonic()
            sent: dict[str, futures.Future] = {}
            while not answered(second) & set(sent):
                assert time.monotonic() < started + 10, "no request reached the worker added to the name"
                request_id = f"spread-{len(sent)}"
                sent[request_id] = pool.submit(c.decide, noul(f"State {len(sent)}."), request_id=request_id, timeout=60)
                time.sleep(0.2)
            print(f"the added worker answered {time.monotonic() - started:.1f} s after it was added")
            # the new channels came while the slow request ran on the old ones, which stayed open
            assert not slow.done(), "the slow request ended before the worker was added: make it slower"
            assert slow.result()["answers"]["q"]["choice"]
            assert all(f.result()["answers"]["q"]["type"] == "noul" for f in sent.values())
    finally:
        for process in reversed(processes):
            process.stop(timeout_seconds=10)


def test_a_name_that_fails_to_resolve_for_a_moment_keeps_its_workers(demo_model, tmp_path):
    """The name stops resolving for 1.5 s (a DNS hiccup) while requests flow: the traffic channel
    stays connected (gRPC keeps a name's last addresses), and so does the frontend's view. Before,
    the refresh that saw no address refused every request UNAVAILABLE for a period, health said
    NOT_SERVING and both traffic channels were rebuilt (a review helper's finding)."""
    good = "127.0.0.1 localhost\n127.0.0.1 wk\n"
    hosts = tmp_path / "hosts"
    hosts.write_text(good)
    python = in_namespace(tmp_path, hosts)
    port = launch.free_port()
    processes = []
    try:
        worker = launch.start_worker(demo_model, tmp_path, [*WORKER_ARGS, "--listen", f"127.0.0.1:{port}"])
        processes.append(worker)
        frontend = launch.start_frontend(
            demo_model, f"dns:///wk:{port}", tmp_path, ["--worker-refresh-seconds", "0.5"], python=python
        )
        processes.append(frontend)
        launch.wait_serving(frontend.address)
        with Client(frontend.address) as c:
            c.decide(noul("Before."), timeout=30)
            hosts.write_text("127.0.0.1 localhost\n")  # in place: the bind mount shows it
            ended = time.monotonic() + 1.5
            answered = 0
            while time.monotonic() < ended:
                assert c.decide(noul(f"During {answered}."), timeout=30)["answers"]["q"]["type"] == "noul"
                answered += 1
            hosts.write_text(good)
            time.sleep(1.0)  # a refresh with the name back: the same addresses, no new channels
            c.decide(noul("After."), timeout=30)
        assert answered > 0
        events = log_events(frontend.log_text(), "worker_lookup_failed")
        assert len(events) == 1 and events[0]["keeping"] == [f"127.0.0.1:{port}"], events
        assert not log_events(frontend.log_text(), "worker_channels"), "the traffic channels were rebuilt"
    finally:
        for process in reversed(processes):
            process.stop(timeout_seconds=10)
