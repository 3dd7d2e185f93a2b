"""Start a worker and a frontend as child processes on loopback and wait until they serve.

Used by `make run`, the end-to-end tests, the benchmark and the soak run, so all of them start
the servers exactly as an operator would (the same entry points and flags). On loopback they
run in plaintext, asked for as an operator must (`--plaintext`); `plaintext=False` leaves it to
the caller's own TLS flags."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# The entry modules, as the images in deploy/ run them too (tests/deploy checks they agree).
WORKER_MODULE = "openjev.worker.main"
FRONTEND_MODULE = "openjev.frontend.main"


class LaunchError(RuntimeError):
    pass


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    port: int
    log_path: Path
    started_at: float = 0.0  # time.monotonic() just before the process was spawned
    serving_seconds: float | None = None  # from spawn to health SERVING, where a caller waited for it

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_seconds: float = 20.0) -> int:
        """SIGTERM, then wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def _wait_port(popen: subprocess.Popen, port_file: Path, log_path: Path, timeout_seconds: float) -> int:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())  # one that exited since: its wait for SERVING says so
        if popen.poll() is not None:
            raise LaunchError(f"exited with {popen.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}")
        time.sleep(0.05)
    raise LaunchError(f"not listening after {timeout_seconds} s:\n{log_path.read_text(errors='replace')[-4000:]}")


def start(
    name: str,
    module: str,
    args: list[str],
    *,
    workdir: Path,
    timeout_seconds: float = 120.0,
    env: dict[str, str] | None = None,
    python: str | Path = sys.executable,
) -> Process:
    """Run `python -m module args --listen 127.0.0.1:0 --port-file ...` and wait for its port.
    `python`: the interpreter of the environment the server is installed in (default: this one)."""
    workdir.mkdir(parents=True, exist_ok=True)
    descriptor, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".port", dir=workdir)
    os.close(descriptor)  # one leaked a start (a soak restarts its worker again and again)
    port_file = Path(path)
    log_path = workdir / f"{name}.log"
    command = [str(python), "-m", module, *args]
    if not any(arg == "--listen" or arg.startswith("--listen=") for arg in args):
        command += ["--listen", "127.0.0.1:0"]
    command += ["--port-file", str(port_file)]
    started_at = time.monotonic()
    popen: subprocess.Popen | None = None
    # A timeout, or Ctrl-C (SIGTERM in `make run`) meanwhile: the server runs in a session of its
    # own, so nothing else stops it. (A signal inside Popen itself, after the fork, still leaks.)
    try:
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        _STARTED.append((name, popen))
        port = _wait_port(popen, port_file, log_path, timeout_seconds)
    except BaseException:
        if popen is not None:
            if popen.poll() is None:
                popen.kill()
            popen.wait()
        raise
    return Process(name, popen, port, log_path, started_at)


# Every server start() spawned in this interpreter, for stop_leftovers.
_STARTED: list[tuple[str, subprocess.Popen]] = []


def stop_leftovers() -> list[str]:
    """Kill every server start() spawned here that still runs; return their names. The tests'
    last resort: each server runs in a session of its own, so one that a failing test left
    behind (started before its try, or a second start that failed) would outlive pytest."""
    left = [name for name, popen in _STARTED if popen.poll() is None]
    for _name, popen in _STARTED:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
    _STARTED.clear()
    return left


# Where free_port draws from: above the ports services usually take, below the kernel's ephemeral range.
FIXED_PORTS_FROM = 20000
_HANDED_OUT: set[int] = set()  # free_port's answers so far


def ephemeral_ports() -> range:
    """The kernel's ephemeral range, which outgoing connections and servers on port 0 draw from."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port() -> int:
    """A loopback port free now, for a server that must come back on the same address. Drawn from
    below the ephemeral range: a port the kernel handed out (bind to port 0) could be given to
    any outgoing connection before the server binds it, and in a loaded CI run one was, within
    the 5 s a worker took to start. Never the same port twice in one process: two drawn before
    either server binds would otherwise both look free (a CI run drew one port for a worker and
    a frontend's metrics)."""
    low = ephemeral_ports().start
    for _ in range(200):
        port = random.randrange(FIXED_PORTS_FROM, low) if low - FIXED_PORTS_FROM >= 1000 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken, or in TIME_WAIT: another
            port = s.getsockname()[1]
        _HANDED_OUT.add(port)
        return port
    raise LaunchError("no free loopback port below the ephemeral range")


def wait_serving(
    address: str,
    timeout_seconds: float = 60.0,
    service: str = "",
    credentials=None,
    options=(),
    process: Process | None = None,
) -> None:
    """Until the server's health says SERVING (credentials, options: a TLS channel's). process: the
    server, where this interpreter started it: one that exits meanwhile fails at once with its
    log's end (it was waited for to the timeout, then "not SERVING")."""
    deadline = time.monotonic() + timeout_seconds
    channel = (
        grpc.insecure_channel(address, options=options)
        if credentials is None
        else grpc.secure_channel(address, credentials, options=options)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.popen.poll() is not None:
                tail = process.log_text()[-4000:]
                raise LaunchError(f"{process.name} exited with {process.popen.returncode} before SERVING:\n{tail}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise LaunchError(f"{address} not SERVING after {timeout_seconds} s")


@dataclass
class Pair:
    worker: Process
    frontend: Process
    extra: list[Process] = field(default_factory=list)

    def stop(self) -> None:
        for process in (self.frontend, self.worker, *self.extra):
            process.stop()


# A worker answers only once warm: on a GPU that includes capturing a CUDA graph for every pass
# shape of its budget, minutes on the 27B shape.
WORKER_START_SECONDS = 900.0


PLAINTEXT = "--plaintext"


def start_worker(
    model: Path,
    workdir: Path,
    extra_args: Sequence[str] = (),
    name: str = "worker",
    python: str | Path = sys.executable,
    timeout_seconds: float = WORKER_START_SECONDS,
    plaintext: bool = True,
) -> Process:
    worker = start(
        name,
        WORKER_MODULE,
        ["--model", str(model), *([PLAINTEXT] if plaintext else []), *extra_args],
        workdir=workdir,
        python=python,
        timeout_seconds=timeout_seconds,
    )
    try:
        wait_serving(worker.address, timeout_seconds, process=worker)
    except BaseException:  # listening but never SERVING (or interrupted): not left running
        worker.stop()
        raise
    worker.serving_seconds = time.monotonic() - worker.started_at
    return worker


def start_frontend(
    model: Path,
    worker_target: str,
    workdir: Path,
    extra_args: Sequence[str] = (),
    python: str | Path = sys.executable,
    plaintext: bool = True,
) -> Process:
    args = ["--model", str(model), "--worker", worker_target, *([PLAINTEXT] if plaintext else []), *extra_args]
    return start("frontend", FRONTEND_MODULE, args, workdir=workdir, python=python)


def start_pair(
    model: Path,
    workdir: Path,
    *,
    worker_args: Sequence[str] = (),
    frontend_args: Sequence[str] = (),
    python: str | Path = sys.executable,
    worker_timeout_seconds: float = WORKER_START_SECONDS,
) -> Pair:
    """Both servers; `python` runs each of them (an installed environment's interpreter)."""
    worker = start_worker(model, workdir, worker_args, python=python, timeout_seconds=worker_timeout_seconds)
    frontend = None
    try:
        frontend = start_frontend(model, worker.address, workdir, frontend_args, python=python)
        wait_serving(frontend.address, process=frontend)
    except BaseException:  # neither server outlives a failed start (each runs in its own session)
        if frontend is not None:
            frontend.stop()
        worker.stop()
        raise
    return Pair(worker, frontend)
