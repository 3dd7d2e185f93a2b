"""Edges of the flag checks both servers share (`common/config.py`), the health probe
(`common/healthcheck.py`), the ABI digests and enum maps (`common/abi.py`) and the frontend's
heap hand-back (`frontend/memory.py`) that no test held: a mutation review changed each of them
and every test still passed."""

from __future__ import annotations

import argparse
import ctypes.util
import hashlib
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from openjev import abi, config, healthcheck, serving
from openjev.contract.literals import PREFIX_POLICIES, PREFIX_SCOPES, QUESTION_KINDS
from openjev.frontend import memory
from openjev.frontend.main import parser as frontend_parser
from openjev.worker.main import parser as worker_parser

# (check, values it takes, values it refuses): each bound, and the first value past it.
BOUNDS = [
    (config.positive_int, ["1"], ["0", "-1", "1.5", "abc"]),
    (config.non_negative_int, ["0", "7"], ["-1", "abc"]),
    (config.positive_float, ["0.001", "1e9"], ["0", "-0.5", "inf", "nan", "abc"]),
    (config.non_negative_float, ["0", "0.25"], ["-0.001", "inf", "nan"]),
    (config.fraction, ["0", "1", "0.3"], ["-0.01", "1.01", "nan"]),
    (config.port_number, ["0", "65535"], ["-1", "65536", "abc"]),
]


@pytest.mark.parametrize(("check", "good", "bad"), BOUNDS, ids=[b[0].__name__ for b in BOUNDS])
def test_each_value_check_takes_its_bounds_and_refuses_what_lies_past_them(check, good, bad):
    """`--grace-seconds 0` (no drain) and `--metrics-port 0` (off) are meant; `--max-watch-streams
    0` or `--timeout 0` would serve nothing or time out at once, `inf` never."""
    for text in good:
        assert check(text) == float(text)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=rf"^expected .*, got '{text}'$"):
            check(text)


def test_a_value_that_is_no_number_is_named_from_the_flag_and_from_its_variable(monkeypatch, capsys):
    """One line naming the flag or variable and what it wants, not argparse's "invalid
    positive_int value" (the check's own name)."""
    with pytest.raises(SystemExit):
        frontend_parser().parse_args(["--model", "m", "--max-watch-streams", "many"])
    assert capsys.readouterr().err == (
        "openjev-frontend: error: argument --max-watch-streams: expected an integer >= 1, got 'many'\n"
    )
    monkeypatch.setenv("OPENJEV_MAX_WATCH_STREAMS", "many")
    with pytest.raises(SystemExit) as exit_:
        config.parse_with_env(frontend_parser(), ["--model", "m"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "environment variable OPENJEV_MAX_WATCH_STREAMS: expected an integer >= 1, got 'many'" in err


@pytest.mark.parametrize("bad", ["127.0.0.1:\u0665\u0660\u0660\u0665\u0661", "127.0.0.1:\uff15\uff10", "[::1:50051"])
def test_a_port_in_other_digits_or_an_unclosed_bracket_is_no_address(bad):
    """str.isdigit() and int() take Arabic-Indic and full-width digits (a pasted address); an
    IPv6 host needs its closing bracket before the port."""
    with pytest.raises(argparse.ArgumentTypeError, match="expected HOST:PORT"):
        config.host_port(bad)
    assert config.host_port("[::1]:50051") == "[::1]:50051"


def test_an_otlp_endpoint_on_port_0_is_refused():
    """Port 0 is for listening; an exporter dialling it exports nothing, without a word."""
    with pytest.raises(argparse.ArgumentTypeError, match="expected http://HOST:PORT"):
        config.otlp_endpoint("http://collector:0")
    assert config.otlp_endpoint("http://collector:1") == "http://collector:1"


def test_a_port_file_under_a_file_is_refused_at_start(tmp_path):
    """Its "folder" exists but is a file: writing the port after the model loaded would fail."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a folder"):
        config.new_file(str(tmp_path / "afile" / "port"))
    assert config.new_file(str(tmp_path / "port")) == tmp_path / "port"


def test_the_log_level_is_read_in_any_case_and_kept_lower_case(monkeypatch):
    assert frontend_parser().parse_args(["--model", "m", "--log-level", "WARNING"]).log_level == "warning"
    monkeypatch.setenv("OPENJEV_LOG_LEVEL", "Debug")
    assert config.parse_with_env(worker_parser(), ["--model", "m"]).log_level == "debug"


def test_a_variable_for_a_flag_with_choices_must_be_one_of_them(monkeypatch, capsys):
    monkeypatch.setenv("OPENJEV_PREFIX_POLICY", "shared")
    assert config.parse_with_env(worker_parser(), ["--model", "m"]).prefix_policy == "shared"
    monkeypatch.setenv("OPENJEV_PREFIX_POLICY", "everything")
    with pytest.raises(SystemExit) as exit_:
        config.parse_with_env(worker_parser(), ["--model", "m"])
    assert exit_.value.code == 2
    assert "environment variable OPENJEV_PREFIX_POLICY: 'everything' is not one of" in capsys.readouterr().err


@pytest.mark.parametrize("make", [worker_parser, frontend_parser], ids=["worker", "frontend"])
def test_a_required_flag_may_come_from_its_variable_alone(monkeypatch, make):
    """docs/deploy.md: every flag has its variable; a container setting OPENJEV_MODEL must not
    also need --model on the command line."""
    monkeypatch.setenv("OPENJEV_MODEL", "/models/open-jev")
    assert str(config.parse_with_env(make(), []).model) == "/models/open-jev"


def test_the_stream_caps_default_as_documented():
    """docs/reliability.md: health Watch streams 32 (256 on the worker, where each frontend holds
    several), reflection streams 8."""
    front = frontend_parser().parse_args(["--model", "m"])
    work = worker_parser().parse_args(["--model", "m"])
    assert (front.max_watch_streams, work.max_watch_streams) == (32, 256)
    assert (front.max_reflection_streams, work.max_reflection_streams) == (8, 8)


def test_the_config_line_redacts_secret_flags_only_where_set():
    """A flag named for a secret is logged as <redacted> (a word of its name, not a part of one);
    one left unset still reads as unset, and a path as its text."""
    assert config.is_secret("worker_auth_token") and config.is_secret("tls_key") and config.is_secret("API_KEY")
    assert not any(map(config.is_secret, ("tokenizer_path", "keyring_dir", "listen", "model")))
    args = argparse.Namespace(auth_token=Path("/run/secret"), tls_key=None, model=Path("/m"), port=5)
    with capture_logs() as lines:
        config.log_config("openjev.test", args)
    (line,) = lines
    assert line["event"] == "config" and line["log_level"] == "info"
    assert (line["auth_token"], line["tls_key"], line["model"], line["port"]) == ("<redacted>", None, "/m", 5)


# -- the health probe, against a real server on loopback ------------------------------------------

SERVICE = "openjev.v1.DecisionService"


@pytest.fixture
def health_server():
    server = serving.build_server("127.0.0.1:0", lambda s: None, [SERVICE])
    try:
        yield server
    finally:
        server.grpc_server.stop(0).wait()


def test_the_probe_fails_a_server_that_is_not_serving_and_names_the_service(health_server, capsys, monkeypatch):
    """NOT_SERVING (starting, or draining on SIGTERM) must fail the probe, or a load balancer keeps
    sending to a server on its way out; --service asks about that service, not the whole server."""
    for flag in healthcheck.TLS_FLAGS:
        monkeypatch.delenv(healthcheck.ENV_PREFIX + flag.upper(), raising=False)
    address = f"127.0.0.1:{health_server.port}"
    assert healthcheck.main([address]) == 1
    assert capsys.readouterr().out == "NOT_SERVING\n"
    health_server.set_serving(True)
    assert healthcheck.main([address, "--service", SERVICE]) == 0
    assert capsys.readouterr().out == "SERVING\n"
    assert healthcheck.main([address, "--service", "no.such.Service"]) == 1
    assert capsys.readouterr().out == "NOT_FOUND\n"


@pytest.mark.parametrize("blank", ["", " \t"])
def test_an_empty_tls_variable_leaves_the_probe_on_plaintext(health_server, monkeypatch, capsys, blank):
    """A variable set empty or blank (how a deployment blanks one it inherits) is unset, as for the
    servers' flags: not the path `.` (or " \t"), which ended the probe in a usage error against a
    plaintext server."""
    health_server.set_serving(True)
    for flag in healthcheck.TLS_FLAGS:
        monkeypatch.setenv(healthcheck.ENV_PREFIX + flag.upper(), blank)
    assert healthcheck.main([f"127.0.0.1:{health_server.port}"]) == 0
    assert capsys.readouterr().out == "SERVING\n"


def test_the_probe_gives_up_on_a_silent_server_after_its_timeout(capsys, monkeypatch):
    """A listener that never answers (a hung process): the probe's --timeout ends the call with
    DEADLINE_EXCEEDED, not gRPC's own connection timeout ~20 s later, past the probe's period."""
    for flag in healthcheck.TLS_FLAGS:
        monkeypatch.delenv(healthcheck.ENV_PREFIX + flag.upper(), raising=False)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connections complete, nothing is read
        assert healthcheck.main([f"127.0.0.1:{silent.getsockname()[1]}", "--timeout", "0.5"]) == 1
    assert capsys.readouterr().out == "DEADLINE_EXCEEDED\n"


def test_a_ca_file_the_probe_cannot_read_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(healthcheck.ENV_PREFIX + "TLS_CA", raising=False)
    missing = tmp_path / "ca.crt"
    with pytest.raises(SystemExit) as exit_:
        healthcheck.main(["127.0.0.1:1", "--tls-ca", str(missing)])
    assert exit_.value.code == 2
    assert f"error: cannot read {missing}: No such file or directory" in capsys.readouterr().err


# -- the ABI's digests and enum maps --------------------------------------------------------------


def test_the_expected_worker_digest_is_the_released_formula():
    """A frontend and a worker of different releases under one ABI version must compute the same
    header, or every call is refused (a rolling upgrade stops serving); each input changes it."""
    released = hashlib.sha256(f"{abi.ABI_VERSION}\nfp\n16384\nopen-jev\n2.5".encode()).hexdigest()[:32]
    assert abi.expected_worker("fp", 16384, "open-jev", 2.5) == released
    others = {
        abi.expected_worker("fp2", 16384, "open-jev", 2.5),
        abi.expected_worker("fp", 8192, "open-jev", 2.5),
        abi.expected_worker("fp", 16384, "open-jev-2", 2.5),
        abi.expected_worker("fp", 16384, "open-jev", 2.25),
    }
    assert released not in others and len(others) == 4
    # a frontend refuses a worker that takes fewer per message than it sends: ABI 1 says 16 (Describe)
    assert abi.BATCH_CANDIDATES == 16
    head = (0.5, -1.0)
    assert abi.weights_fingerprint("cfg", head, 0.25) != abi.weights_fingerprint("cfg", (0.5, -1.5), 0.25)


def test_each_literal_maps_to_its_enum_and_back_and_an_unknown_value_is_a_key_error():
    """Callers catch KeyError for a value a newer peer sent (proto3 enums are open): a default in
    its place would read it as a known policy, scope or kind."""
    for name in PREFIX_POLICIES:
        assert abi.policy_from_enum(abi.policy_to_enum(name)) == name
    for name in PREFIX_SCOPES:
        assert abi.scope_from_enum(abi.scope_to_enum(name)) == name
    for name in QUESTION_KINDS:
        assert abi.kind_from_enum(abi.kind_to_enum(name)) == name
    assert abi.policy_from_enum(abi.policy_to_enum(None)) is None
    for lookup in (abi.policy_from_enum, abi.scope_from_enum, abi.kind_from_enum):
        with pytest.raises(KeyError):
            lookup(99)
    with pytest.raises(KeyError):
        abi.policy_to_enum("everything")  # type: ignore[arg-type]


# -- the heap hand-back ---------------------------------------------------------------------------

# Where a block of each size came from, once the threshold is set (mallinfo2: bytes held in mmap'd
# chunks), in a fresh process: the threshold is the whole process's.
THRESHOLD_SCRIPT = textwrap.dedent(
    """
    import ctypes
    from openjev.frontend.memory import return_large_blocks

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                  "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    assert return_large_blocks(4 << 20)

    def mmapped(size):
        before = libc.mallinfo2().hblkhd
        block = bytearray(size)
        return libc.mallinfo2().hblkhd - before >= size

    print(mmapped(2 << 20), mmapped(8 << 20))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_blocks_from_the_threshold_up_are_mmapd_and_smaller_ones_not():
    """mallopt's M_MMAP_THRESHOLD, not another parameter (M_TRIM_THRESHOLD, -1, also fixes the
    moving threshold, but at glibc's 128 KiB: every block past it would be a system call)."""
    done = subprocess.run([sys.executable, "-c", THRESHOLD_SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


def test_without_glibcs_functions_nothing_is_changed_and_both_say_so(monkeypatch):
    """musl (Alpine) has neither mallopt nor malloc_trim: both report False rather than failing
    the frontend's start."""
    monkeypatch.setattr(memory, "_libc", lambda: object())
    assert memory.return_large_blocks() is False and memory.trim_heap() is False
    monkeypatch.setattr(memory, "_libc", lambda: None)
    assert memory.return_large_blocks() is False and memory.trim_heap() is False


def test_a_c_library_that_cannot_be_found_or_loaded_is_none(monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert memory._libc.__wrapped__() is None
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libopenjev-no-such-c.so.6")
    assert memory._libc.__wrapped__() is None
