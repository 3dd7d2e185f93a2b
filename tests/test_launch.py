"""The launch helpers' ports: a server restarted on its address must find that address free."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openjev.tools import launch


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    """Below the range the kernel hands to outgoing connections, which took a port between
    free_port and the worker's bind in a loaded CI run (`Address already in use`); drawn at
    random, so that two test processes do not pick the same one."""
    ephemeral = launch.ephemeral_ports()
    if ephemeral.start - launch.FIXED_PORTS_FROM < 1000:
        pytest.skip(f"this kernel's ephemeral range starts at {ephemeral.start}")
    ports = [launch.free_port() for _ in range(20)]
    assert all(launch.FIXED_PORTS_FROM <= port < ephemeral.start for port in ports), ports
    assert len(set(ports)) > 1, ports
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", ports[0]))
        server.listen()
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=5):
            pass


def test_ports_drawn_before_any_server_binds_are_all_different():
    """A worker's port and a frontend's metrics port are drawn before either binds; a CI run drew
    the same one for both. Among 500 draws from some 12,000 ports, random draws alone would repeat
    about ten times."""
    if launch.ephemeral_ports().start - launch.FIXED_PORTS_FROM < 1000:
        pytest.skip("this kernel's ephemeral range leaves no fixed ports")
    ports = [launch.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def _listening_never_serving(tmp_path: Path, port: bool = True) -> Path:
    """A stand-in interpreter: it writes a port file as a server does (a port nothing serves; none
    at all with port=False, as a worker still loading) and its pid beside it, then sleeps as a
    server that never says SERVING."""
    script = tmp_path / "fake-python"
    writes_port = '; echo 1 > "$file"' if port else ""
    script.write_text(
        "#!/bin/sh\n"
        'while [ $# -gt 0 ]; do [ "$1" = --port-file ] && file=$2; shift; done\n'
        f'echo $$ > "$file.pid"{writes_port}\n'
        "exec sleep 600\n"
    )
    script.chmod(0o755)
    return script


def _launcher(tmp_path: Path, code: str, port: bool = True) -> subprocess.CompletedProcess:
    """`code` in a process of its own, its argv the workdir and a stand-in interpreter."""
    python = _listening_never_serving(tmp_path, port)
    return subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "w"), str(python)], capture_output=True, text=True, timeout=60
    )


def _pids(workdir: Path) -> list[int]:
    return [int(p.read_text()) for p in workdir.glob("*.port.pid")]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_worker_that_never_serves_is_stopped(tmp_path):
    """start_worker gave up with LaunchError and left the process running in its own session."""
    with pytest.raises(launch.LaunchError, match="not SERVING"):
        launch.start_worker(tmp_path, tmp_path / "w", python=_listening_never_serving(tmp_path), timeout_seconds=1)
    [pid] = _pids(tmp_path / "w")
    assert not _running(pid)


def test_a_server_that_exits_after_its_port_fails_at_once(tmp_path):
    """A server that wrote its port file and then died: start_worker waited out its whole timeout
    and said "not SERVING", without the exit code or the log (a review helper's finding)."""
    script = tmp_path / "dying-python"
    script.write_text(
        "#!/bin/sh\n"
        'while [ $# -gt 0 ]; do [ "$1" = --port-file ] && file=$2; shift; done\n'
        'echo 1 > "$file"; sleep 1; echo "it went wrong"; exit 3\n'
    )
    script.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(launch.LaunchError, match="worker exited with 3 before SERVING:\n.*it went wrong"):
        launch.start_worker(tmp_path, tmp_path / "w", python=script, timeout_seconds=60)
    assert time.monotonic() - started < 10


def test_a_start_leaves_no_descriptor_open(tmp_path):
    """start() kept the port file's descriptor from mkstemp open, one a start."""
    python = _listening_never_serving(tmp_path)
    for i in range(3):
        launch.start(f"s{i}", "any", [], workdir=tmp_path / "w", python=python).kill()
    fds = Path("/proc/self/fd")
    held = []
    for fd in fds.iterdir():
        try:
            held.append(os.readlink(fd))
        except OSError:  # closed meanwhile (listing the folder opened one)
            continue
    assert not [target for target in held if target.endswith(".port")], held


def test_stop_leftovers_kills_what_a_failed_test_left(tmp_path):
    """In a process of its own, as pytest's session end (conftest) calls it: it may not touch the
    servers of this one."""
    code = (
        "import sys; from pathlib import Path; from openjev.tools import launch\n"
        "launch.start('left-behind', 'any', [], workdir=Path(sys.argv[1]), python=sys.argv[2])\n"
        "print(launch.stop_leftovers(), launch.stop_leftovers())\n"
    )
    done = _launcher(tmp_path, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "['left-behind'] []"
    [pid] = _pids(tmp_path / "w")
    assert not _running(pid)


def test_an_interrupted_start_stops_the_server(tmp_path):
    """Ctrl-C while start() waits for the port (a worker loading its model): the server, in a
    session of its own, was left running (a review helper's finding: `make run` interrupted)."""
    code = (
        "import signal, sys; from pathlib import Path; from openjev.tools import launch\n"
        "def interrupt(*_): raise KeyboardInterrupt\n"
        "signal.signal(signal.SIGALRM, interrupt); signal.alarm(1)\n"
        "launch.start('interrupted', 'any', [], workdir=Path(sys.argv[1]), python=sys.argv[2])\n"
    )
    done = _launcher(tmp_path, code, port=False)
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr, done.stderr
    [pid] = _pids(tmp_path / "w")
    assert not _running(pid)


def test_make_run_stopped_by_sigterm_stops_both_servers(demo_model, tmp_path):
    """`make run` ended by SIGTERM (a `timeout`, a CI job's end) while its servers start: both were
    left running (a review helper's finding); now it exits 143 and stops them."""
    import signal
    import time

    request = Path(__file__).resolve().parents[1] / "examples" / "contract_example.json"
    demo = subprocess.Popen(
        [sys.executable, "-m", "openjev.tools.demo_run", "--model", str(demo_model), "--request", str(request)],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert demo.stderr is not None
    first = demo.stderr.readline()  # "starting worker and frontend (logs in DIR) ..."
    workdir = first.split("logs in ")[1].split(")")[0]
    deadline = time.monotonic() + 30
    spawned = ["pgrep", "-f", f"port-file {workdir}"]
    while subprocess.run(spawned, capture_output=True).returncode:  # the worker runs, loading its model
        assert time.monotonic() < deadline, first
        time.sleep(0.02)
    time.sleep(0.2)  # Popen has returned (a signal inside it still leaks the child: launch.start)
    demo.send_signal(signal.SIGTERM)
    assert demo.wait(timeout=60) == 143
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", workdir], capture_output=True, text=True).stdout.split()
    assert left == [], left
