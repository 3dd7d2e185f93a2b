"""What a mutation review of tools/launch.py and frontend/worker_targets.py found untested: how a server
is stopped (its exit code, a drain after SIGTERM, one that ignores it), where it is told to listen, its
log and session, the ports drawn for it, what "SERVING" means, a pair whose frontend fails, and the
`--worker` forms an operator writes. Each test here failed with one small change to that code."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from test_dns_workers import in_namespace
from test_launch import _launcher, _listening_never_serving, _pids, _running

from openjev.frontend.worker_targets import parse_worker_targets
from openjev.tools import launch


def _stand_in(tmp_path: Path, body: str, name: str = "stand-in") -> Path:
    """An interpreter that runs `body` (sh) as the server: $file is its --port-file, its arguments
    are left as given, and its pid is written beside the port file first."""
    script = tmp_path / name
    script.write_text(
        "#!/bin/sh\n"
        'prev=; for a in "$@"; do [ "$prev" = --port-file ] && file=$a; prev=$a; done\n'
        'echo $$ > "$file.pid"\n' + body + "\n"
    )
    script.chmod(0o755)
    return script


# A stand-in interpreter for start_pair: a gRPC health server SERVING on loopback, as both servers
# are; it prints its arguments (into its log) and exits 0 on SIGTERM. `--exit-when-asked` among
# them: it exits 3 at its first health Check (a server that fails after binding, and only once
# asked, so that it is wait_serving that sees it go, not the wait for its port).
_HEALTH_SERVER = """
import signal, sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
args = sys.argv[1:]
port_file = args[args.index("--port-file") + 1]
open(port_file + ".pid", "w").write(str(__import__("os").getpid()))
print("argv", " ".join(args), flush=True)
class ExitsWhenAsked(health.HealthServicer):
    def Check(self, request, context):
        __import__("os")._exit(3)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
server = grpc.server(futures.ThreadPoolExecutor(2))
servicer = ExitsWhenAsked() if "--exit-when-asked" in args else health.HealthServicer()
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
open(port_file, "w").write(str(port))
signal.sigwait({signal.SIGTERM})
server.stop(0)
"""


def _health_stand_in(tmp_path: Path) -> Path:
    script = tmp_path / "health-python"
    script.write_text(f"#!{sys.executable}\n{_HEALTH_SERVER}")
    script.chmod(0o755)
    return script


def _argv(process: launch.Process) -> str:
    [line] = [line for line in process.log_text().splitlines() if line.startswith("argv ")]
    return line


# --- stopping a server ----------------------------------------------------------------------------


def test_stop_lets_a_server_drain_after_sigterm_and_returns_its_exit_code(tmp_path):
    """stop() is SIGTERM first (a worker drains its requests, then exits on its own), with time
    for it: its exit code, not SIGKILL's."""
    python = _stand_in(
        tmp_path,
        'sleep 600 & child=$!\necho $child > "$file.child"\n'
        "trap 'kill $child; sleep 0.5; exit 7' TERM\n"
        'echo 1 > "$file"\nwait',
    )
    process = launch.start("draining", "any", [], workdir=tmp_path / "w", python=python)
    try:
        assert process.stop() == 7
    finally:
        process.kill()
        [child] = (tmp_path / "w").glob("*.port.child")
        if _running(pid := int(child.read_text())):  # the server was killed, not stopped
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_stop_kills_a_server_that_ignores_sigterm(tmp_path):
    python = _stand_in(tmp_path, "trap '' TERM\necho 1 > \"$file\"\nexec sleep 600")
    process = launch.start("stuck", "any", [], workdir=tmp_path / "w", python=python)
    try:
        assert process.stop(timeout_seconds=0.2) == -signal.SIGKILL
        assert not _running(process.popen.pid)
    finally:
        process.kill()


def test_kill_reaps_the_server(tmp_path):
    process = launch.start("killed", "any", [], workdir=tmp_path / "w", python=_listening_never_serving(tmp_path))
    process.kill()
    assert process.popen.returncode == -signal.SIGKILL


def test_stop_leftovers_names_only_what_still_ran_and_reaps_it(tmp_path):
    """In a process of its own (it would kill this one's servers too): a server stopped before is
    not named as left behind, and the one killed is waited for, not left a zombie."""
    code = (
        "import sys; from pathlib import Path; from openjev.tools import launch\n"
        "left = launch.start('left-behind', 'any', [], workdir=Path(sys.argv[1]), python=sys.argv[2])\n"
        "launch.start('stopped', 'any', [], workdir=Path(sys.argv[1]), python=sys.argv[2]).stop()\n"
        "print(launch.stop_leftovers(), left.popen.returncode)\n"
    )
    done = _launcher(tmp_path, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"['left-behind'] {-signal.SIGKILL}"


def test_pair_stop_stops_the_extra_servers_too(tmp_path):
    python = _listening_never_serving(tmp_path)
    worker, frontend, extra = (
        launch.start(name, "any", [], workdir=tmp_path / "w", python=python) for name in ("w", "f", "x")
    )
    try:
        launch.Pair(worker, frontend, [extra]).stop()
        assert [p.popen.returncode for p in (worker, frontend, extra)] == [-signal.SIGTERM] * 3
    finally:
        for process in (worker, frontend, extra):
            process.kill()


# --- starting a server ----------------------------------------------------------------------------


def test_a_server_that_exits_before_its_port_fails_at_once_with_its_log(tmp_path):
    """A worker that refuses its flags exits before it listens: its exit code and log, not a wait
    for the whole timeout."""
    python = _stand_in(tmp_path, 'echo "no model here"\nexit 3')
    with pytest.raises(launch.LaunchError, match="exited with 3:\nno model here"):
        launch.start("refused", "any", [], workdir=tmp_path / "w", python=python, timeout_seconds=20)


def test_a_server_that_exits_right_after_its_port_is_named_by_the_wait_for_serving(tmp_path):
    """Its port file was written: the wait for SERVING names the server that went (the port's
    wait, checking the exit first, said only "exited with 3" about half the time)."""
    python = _stand_in(tmp_path, 'echo 4242 > "$file"\necho "bound, then failed"\nexit 3')
    with pytest.raises(launch.LaunchError, match="^worker exited with 3 before SERVING:\nbound, then failed"):
        launch.start_worker(tmp_path, tmp_path / "w", python=python, timeout_seconds=20)


def test_a_port_file_seen_empty_is_read_again(tmp_path):
    """The servers write their port file with write_text: created empty, then written."""
    python = _stand_in(tmp_path, ': > "$file"\nsleep 1\necho 4242 > "$file"\nexec sleep 600')
    process = launch.start("slow-port", "any", [], workdir=tmp_path / "w", python=python)
    process.kill()
    assert process.port == 4242


def _args_stand_in(tmp_path: Path) -> Path:
    return _stand_in(tmp_path, 'echo "$@" > "$file.args"\necho 1 > "$file"\nexec sleep 600')


def _args_of(process: launch.Process) -> str:
    [args] = (process.log_path.parent).glob("*.port.args")
    return args.read_text().strip()


def test_a_server_listens_on_loopback_unless_told_where(tmp_path):
    """Not on every interface: on loopback, in plaintext (launch's servers have no TLS)."""
    started = launch.start("default", "any", ["--model", "m"], workdir=tmp_path / "a", python=_args_stand_in(tmp_path))
    started.kill()
    assert _args_of(started).startswith("-m any --model m --listen 127.0.0.1:0 --port-file ")
    # an IP: a pair's frontend given a name would resolve it (dns:///) and turn affinity on
    assert started.address == f"127.0.0.1:{started.port}"
    given = ["--listen", "127.0.0.1:5"]
    started = launch.start("given", "any", given, workdir=tmp_path / "b", python=_args_stand_in(tmp_path))
    started.kill()
    assert _args_of(started).startswith("-m any --listen 127.0.0.1:5 --port-file ")
    given = ["--listen=127.0.0.1:6"]  # argparse's other spelling: another --listen after it would win
    started = launch.start("given-as-one", "any", given, workdir=tmp_path / "c", python=_args_stand_in(tmp_path))
    started.kill()
    assert _args_of(started).startswith("-m any --listen=127.0.0.1:6 --port-file ")


def test_the_environment_given_wins_over_this_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENJEV_MUTANT_PROBE", "inherited")
    python = _stand_in(tmp_path, 'echo "$OPENJEV_MUTANT_PROBE" > "$file.env"\necho 1 > "$file"\nexec sleep 600')
    process = launch.start(
        "env", "any", [], workdir=tmp_path / "w", python=python, env={"OPENJEV_MUTANT_PROBE": "given"}
    )
    process.kill()
    [env] = (tmp_path / "w").glob("*.port.env")
    assert env.read_text().strip() == "given"


def test_a_server_runs_in_a_session_of_its_own(tmp_path):
    """Ctrl-C in the terminal reaches the launcher only, which stops its servers itself."""
    process = launch.start("session", "any", [], workdir=tmp_path / "w", python=_listening_never_serving(tmp_path))
    try:
        assert os.getsid(process.popen.pid) == process.popen.pid != os.getsid(0)
    finally:
        process.kill()


def test_a_restarted_servers_log_keeps_the_earlier_run(tmp_path):
    """A soak restarts its worker under one name: the log of the run before stays readable."""
    python = _stand_in(tmp_path, 'echo "run $$"\necho 1 > "$file"\nexec sleep 600')
    runs = []
    for _ in range(2):
        process = launch.start("worker", "any", [], workdir=tmp_path / "w", python=python)
        process.kill()
        runs.append(f"run {process.popen.pid}")
    assert process.log_text().split("\n")[:2] == runs


def test_started_at_is_taken_before_the_server_starts(tmp_path):
    """serving_seconds (the benchmarks' "SERVING N s after start") counts from the spawn, not from
    the port: here the stand-in writes its port only once the test says so."""
    go = tmp_path / "go"
    python = _stand_in(tmp_path, f'while [ ! -e "{go}" ]; do sleep 0.02; done\necho 1 > "$file"\nexec sleep 600')
    said_go: list[float] = []

    def say_go() -> None:
        deadline = time.monotonic() + 60
        while not _pids(tmp_path / "w") and time.monotonic() < deadline:  # the stand-in runs
            time.sleep(0.02)
        said_go.append(time.monotonic())
        go.touch()

    thread = threading.Thread(target=say_go)
    thread.start()
    process = launch.start("timed", "any", [], workdir=tmp_path / "w", python=python)
    thread.join()
    process.kill()
    assert process.started_at < said_go[0]


# --- ports ----------------------------------------------------------------------------------------


def test_the_ephemeral_range_is_the_kernels(tmp_path):
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    assert launch.ephemeral_ports() == range(low, high + 1)


def test_without_proc_the_ephemeral_range_is_linuxs_default(monkeypatch):
    def unreadable(_path):
        def read_text():
            raise PermissionError("/proc/sys/net/ipv4/ip_local_port_range")

        return SimpleNamespace(read_text=read_text)

    monkeypatch.setattr(launch, "Path", unreadable)
    assert launch.ephemeral_ports() == range(32768, 61000)


def test_free_ports_stay_below_the_ephemeral_range_over_many_draws():
    """Twenty draws (test_launch) miss a bound that reaches 1,000 ports into the range half the time."""
    ephemeral = launch.ephemeral_ports()
    if ephemeral.start - launch.FIXED_PORTS_FROM < 1000:
        pytest.skip(f"this kernel's ephemeral range starts at {ephemeral.start}")
    ports = [launch.free_port() for _ in range(1000)]
    assert max(ports) < ephemeral.start and min(ports) >= launch.FIXED_PORTS_FROM


def test_a_drawn_port_that_is_taken_is_skipped(monkeypatch):
    """A draw that hits a port some server holds: the next draw, not the taken port."""
    with socket.socket() as taken, socket.socket() as probe:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()  # free again (never connected: no TIME_WAIT)
        draws = iter([taken.getsockname()[1], free])
        monkeypatch.setattr(launch, "random", SimpleNamespace(randrange=lambda *_: next(draws)))
        assert launch.free_port() == free


def test_a_kernel_with_no_fixed_ports_gives_a_port_it_chose(monkeypatch):
    """An ephemeral range that starts near FIXED_PORTS_FROM: the kernel's choice, a real port."""
    monkeypatch.setattr(launch, "ephemeral_ports", lambda: range(launch.FIXED_PORTS_FROM + 500, 61000))
    port = launch.free_port()
    assert port != 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# --- readiness ------------------------------------------------------------------------------------


class _FailsFirst(health.HealthServicer):
    """A health service that is not up for its first Check (a server still starting)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def Check(self, request, context):
        self.calls += 1
        if self.calls == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "starting")
        return super().Check(request, context)


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = _FailsFirst()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_wait_serving_waits_for_serving(health_server):
    """NOT_SERVING (a worker still warming up, a frontend whose workers are away) is no answer to
    wait for; a server that failed a Check while it started is asked again."""
    servicer, address = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(launch.LaunchError, match="not SERVING after 0.5 s"):
        launch.wait_serving(address, timeout_seconds=0.5)
    assert servicer.calls >= 2
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    launch.wait_serving(address, timeout_seconds=30)


def test_wait_serving_keeps_asking_a_server_that_is_not_up_yet(health_server):
    servicer, address = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    launch.wait_serving(address, timeout_seconds=30)
    assert servicer.calls == 2


def test_wait_serving_asks_about_the_service_named(health_server):
    servicer, address = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("openjev.worker", health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(launch.LaunchError, match="not SERVING"):
        launch.wait_serving(address, timeout_seconds=0.5, service="openjev.worker")


@pytest.mark.timeout(30)
def test_start_worker_gives_up_after_its_own_timeout(tmp_path):
    python = _listening_never_serving(tmp_path)
    with pytest.raises(launch.LaunchError, match="not SERVING after 1 s"):
        launch.start_worker(tmp_path, tmp_path / "w", python=python, timeout_seconds=1)


@pytest.mark.timeout(30)
def test_start_pair_gives_the_worker_its_timeout(tmp_path):
    python = _listening_never_serving(tmp_path)
    with pytest.raises(launch.LaunchError, match="not SERVING after 1 s"):
        launch.start_pair(tmp_path, tmp_path / "w", python=python, worker_timeout_seconds=1)
    assert not any(_running(pid) for pid in _pids(tmp_path / "w"))


def test_start_pair_points_a_plaintext_frontend_at_its_worker(tmp_path):
    pair = launch.start_pair(
        tmp_path / "model", tmp_path / "w", python=_health_stand_in(tmp_path), worker_timeout_seconds=60
    )
    try:
        assert pair.worker.serving_seconds is not None and pair.worker.serving_seconds > 0
        assert _argv(pair.worker).startswith(f"argv -m {launch.WORKER_MODULE} --model {tmp_path / 'model'} --plaintext")
        want = (
            f"argv -m {launch.FRONTEND_MODULE} --model {tmp_path / 'model'} --worker {pair.worker.address} --plaintext"
        )
        assert _argv(pair.frontend).startswith(want)
    finally:
        pair.stop()
    assert [pair.worker.popen.returncode, pair.frontend.popen.returncode] == [0, 0]


def test_a_frontend_that_fails_after_binding_fails_the_pair_and_stops_the_worker(tmp_path):
    with pytest.raises(launch.LaunchError, match="frontend exited with 3 before SERVING"):
        launch.start_pair(
            tmp_path,
            tmp_path / "w",
            frontend_args=["--exit-when-asked"],
            python=_health_stand_in(tmp_path),
            worker_timeout_seconds=60,
        )
    pids = _pids(tmp_path / "w")
    assert len(pids) == 2 and not any(_running(pid) for pid in pids)


# --- --worker forms -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "traffic", "name", "port"),
    [
        # a compose service name
        ("dns:///openjev_worker:50052", "dns:///openjev_worker:50052", "openjev_worker", 50052),
        # a fully qualified name (Kubernetes' search-path-free form)
        (
            "dns:///w.openjev.svc.cluster.local.:50052",
            "dns:///w.openjev.svc.cluster.local.:50052",
            "w.openjev.svc.cluster.local.",
            50052,
        ),
        # the longest label a name may have
        (f"dns:///{'w' * 63}.openjev:1", f"dns:///{'w' * 63}.openjev:1", f"{'w' * 63}.openjev", 1),
        # OPENJEV_WORKER from a file, its newline kept
        (" dns:///localhost:50052\n", "dns:///localhost:50052", "localhost", 50052),
        # an IPv6 literal resolved as a name: in brackets for gRPC
        ("dns:///[::1]:50052", "dns:///[::1]:50052", "::1", 50052),
        ("localhost:65535", "dns:///localhost:65535", "localhost", 65535),
    ],
)
def test_names_an_operator_writes(text, traffic, name, port):
    targets = parse_worker_targets(text)
    assert targets.traffic_target == traffic and targets.fixed is None
    assert (targets.name, targets.port) == (name, port)


def test_a_list_with_a_trailing_comma_is_its_addresses():
    targets = parse_worker_targets("127.0.0.1:1,127.0.0.1:65535,")
    assert targets.traffic_target == "ipv4:127.0.0.1:1,127.0.0.1:65535"
    assert targets.endpoints() == ["127.0.0.1:1", "127.0.0.1:65535"]


def test_an_ipv6_name_target_describes_its_worker_in_brackets():
    assert parse_worker_targets("dns:///[::1]:50052").endpoints() == ["[::1]:50052"]


def test_a_name_that_does_not_resolve_has_no_endpoints():
    """None (not []): the link keeps the workers it last found (test_dns_workers: a DNS hiccup)."""
    assert parse_worker_targets("dns:///openjev-worker.invalid:50052").endpoints() is None


def test_a_names_addresses_are_each_worker_once_in_order(tmp_path):
    """/etc/hosts (or DNS) may give an address twice: one probe per worker, in a stable order."""
    hosts = tmp_path / "hosts"
    # six addresses: a set's order (string hashes, random in each process) is sorted once in 720
    scrambled = [5, 3, 7, 2, 6, 4, 3]
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"127.0.0.{i} wk\n" for i in scrambled))
    python = in_namespace(tmp_path, hosts)
    code = "from openjev.frontend.worker_targets import parse_worker_targets as p; print(p('dns:///wk:7').endpoints())"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([f"127.0.0.{i}:7" for i in range(2, 8)])
