"""Flag values the servers and the CLI refuse at start with one line, where gRPC or a late write
would otherwise act on them silently or with a traceback (a review of 2026-12-02: `--listen
127.0.0.1` served on port 443, `:70000` on 4464, `decide --addr` dialled the same; a
`--port-file` in a missing folder and a non-UTF-8 `--auth-token-file` ended in tracebacks)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from openjev import config, security, serving
from openjev.frontend.main import parser as frontend_parser
from openjev.tools.cli import parser as cli_parser
from openjev.worker.main import parser as worker_parser

BAD = ["127.0.0.1", "127.0.0.1:70000", "127.0.0.1:-1", ":50051", "127.0.0.1:", "127.0.0.1:5x", ""]


@pytest.mark.parametrize("good", ["127.0.0.1:0", "0.0.0.0:50051", "[::]:50051", "localhost:65535"])
def test_host_port_accepts(good):
    assert config.host_port(good) == good


@pytest.mark.parametrize("bad", BAD)
def test_host_port_refuses(bad):
    with pytest.raises(Exception, match="expected HOST:PORT with a port 0..65535"):
        config.host_port(bad)


@pytest.mark.parametrize("bad", ["http://127.0.0.1:50051", "::1:50051", "dns:///workers:50051", "a/b:1"])
def test_a_url_or_a_bare_ipv6_address_is_no_host_port(bad):
    """Both passed (the port was found after the last colon) and every call then failed UNAVAILABLE,
    `Misformatted domain name`, where a usage error belongs."""
    with pytest.raises(Exception, match="no scheme; an IPv6 address in brackets"):
        config.dial_address(bad)


def test_a_dialled_port_is_never_0():
    with pytest.raises(Exception, match="port 1..65535"):
        config.dial_address("127.0.0.1:0")


@pytest.mark.parametrize("make", [worker_parser, frontend_parser], ids=["worker", "frontend"])
@pytest.mark.parametrize("bad", ["127.0.0.1", "127.0.0.1:70000"])
def test_servers_refuse_a_listen_address_without_a_valid_port(make, bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        make().parse_args(["--model", "m", "--listen", bad])
    assert exit_.value.code == 2 and "--listen: expected HOST:PORT" in capsys.readouterr().err


def test_the_environment_variable_is_checked_too(monkeypatch, capsys):
    monkeypatch.setenv("OPENJEV_LISTEN", "127.0.0.1:70000")
    with pytest.raises(SystemExit):
        config.parse_with_env(frontend_parser(), ["--model", "m"])
    assert "environment variable OPENJEV_LISTEN: expected HOST:PORT" in capsys.readouterr().err


def test_frontend_refuses_a_bad_http_listen_and_keeps_it_off_when_empty():
    assert frontend_parser().parse_args(["--model", "m", "--http-listen", ""]).http_listen == ""
    with pytest.raises(SystemExit):
        frontend_parser().parse_args(["--model", "m", "--http-listen", "127.0.0.1:70000"])


def test_decide_refuses_an_address_without_a_valid_port():
    for bad in ("127.0.0.1", "127.0.0.1:70000", "127.0.0.1:0"):
        with pytest.raises(SystemExit):
            cli_parser().parse_args(["decide", "r.json", "--addr", bad])


@pytest.mark.parametrize("bad", ["not a url", "collector:4317", "http://collector", "ftp://collector:4317"])
def test_servers_refuse_an_otlp_endpoint_that_is_not_a_url(bad, capsys):
    with pytest.raises(SystemExit):
        worker_parser().parse_args(["--model", "m", "--otlp-endpoint", bad])
    assert "--otlp-endpoint: expected http://HOST:PORT" in capsys.readouterr().err


def test_an_otlp_endpoint_with_credentials_is_refused(capsys):
    """user:password@ in the URL passed the flag's check and went into the config log line."""
    with pytest.raises(SystemExit):
        frontend_parser().parse_args(["--model", "m", "--otlp-endpoint", "http://user:secret@collector:4317"])
    err = capsys.readouterr().err
    assert "credentials in the URL are not taken" in err and "secret" not in err


def test_an_otlp_endpoint_url_is_taken_and_empty_is_off():
    for good in ("http://collector:4317", "https://10.0.0.5:4317/", ""):
        assert frontend_parser().parse_args(["--model", "m", "--otlp-endpoint", good]).otlp_endpoint == good


def test_port_file_in_a_missing_folder_is_refused_at_start(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "openjev.worker.main", "--model", "m", "--port-file", str(tmp_path / "no" / "p")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--port-file:" in out.stderr and "is not a folder" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_token_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "tokens"
    path.write_bytes(b"\xff\xfe not text\n")
    with pytest.raises(security.SecurityError, match="not UTF-8 text"):
        security.load_tokens(path, environ={})


def test_a_token_no_client_could_present_is_refused_at_start(tmp_path):
    """HTTP reads headers as latin-1 and gRPC takes ASCII metadata only: a token with another
    character would be configured and never match (the token itself is not shown)."""
    path = tmp_path / "tokens"
    path.write_text("# comment\ns3cret\ntökén\n", encoding="utf-8")
    with pytest.raises(security.SecurityError, match=r"tokens: token 2 has characters other than printable ASCII"):
        security.load_tokens(path, environ={})
    with pytest.raises(security.SecurityError, match=r"\$OPENJEV_AUTH_TOKENS: token 1 ") as refused:
        security.load_tokens(None, environ={"OPENJEV_AUTH_TOKENS": "sec\tret, fine"})
    assert "sec" not in str(refused.value)
    assert security.load_tokens(None, environ={"OPENJEV_AUTH_TOKENS": "a b,c"}) == (b"a b", b"c")


@pytest.mark.parametrize("stray", ["\x0b", "\x0c", "\x1c", "\x1e", "\x85", "\u2028"])
def test_a_control_character_in_a_token_file_refuses_it_rather_than_splitting_the_token(tmp_path, stray):
    """splitlines() cut a line at VT, FF, FS..RS, NEL and U+2028 too: one token became two
    shorter ones, each accepted, and the printable-ASCII check saw only the pieces."""
    path = tmp_path / "tokens"
    path.write_text(f"LongSecretPart1{stray}LongSecretPart2\n", encoding="utf-8")
    with pytest.raises(security.SecurityError, match=r"token 1 has characters other than printable ASCII"):
        security.load_tokens(path, environ={})


def test_a_token_file_with_a_bom_and_crlf_lines_loads_its_tokens(tmp_path):
    """A UTF-8 BOM (as Windows editors save) made the first line, a comment, read as token 1."""
    path = tmp_path / "tokens"
    path.write_bytes(b"\xef\xbb\xbf# production tokens\r\n  tok-one \r\n\r\ntok-two\r\n")
    assert security.load_tokens(path, environ={}) == (b"tok-one", b"tok-two")


def test_only_spaces_and_tabs_may_surround_a_presented_token():
    """str.strip() also removed NBSP, NEL and FS..US around a token (HTTP headers are read as
    latin-1): a proxy comparing the header exactly would refuse what the frontend accepted."""
    auth = security.BearerAuth((b"tok-one",))
    assert auth.allowed("Bearer tok-one") and auth.allowed("Bearer  tok-one\t") and auth.allowed("bearer tok-one")
    for header in ("Bearer tok-one\xa0", "Bearer tok-one\x85", "Bearer \x1ctok-one", "Bearer tok-one\x1f"):
        assert not auth.allowed(header), repr(header)
    assert not auth.allowed("Bearer tok-on")


@pytest.mark.parametrize("value", ["enabled", "y", "garbage"])
def test_an_on_off_variable_with_another_value_is_refused(monkeypatch, capsys, value):
    """OPENJEV_HTTP_METRICS=enabled was silently off (anything but 1/true/yes/on was)."""
    monkeypatch.setenv("OPENJEV_HTTP_METRICS", value)
    with pytest.raises(SystemExit) as exit_:
        config.parse_with_env(frontend_parser(), ["--model", "m"])
    assert exit_.value.code == 2
    assert (
        f"environment variable OPENJEV_HTTP_METRICS: expected one of 1, true, yes, on, 0, false, no, off, got {value!r}"
        in (capsys.readouterr().err)
    )


@pytest.mark.parametrize(("value", "on"), [("1", True), ("TRUE", True), (" on ", True), ("0", False), ("off", False)])
def test_an_on_off_variable_reads_both_ways(monkeypatch, value, on):
    monkeypatch.setenv("OPENJEV_HTTP_METRICS", value)
    assert config.parse_with_env(frontend_parser(), ["--model", "m"]).http_metrics is on


def test_a_flag_given_wins_over_a_bad_variable(monkeypatch):
    """docs/deploy.md: "a flag on the command line wins"; a bad inherited variable stopped the
    server even where the flag set the value."""
    monkeypatch.setenv("OPENJEV_METRICS_PORT", "garbage")
    monkeypatch.setenv("OPENJEV_HTTP_METRICS", "enabled")
    args = config.parse_with_env(frontend_parser(), ["--model", "m", "--metrics-port", "9090", "--http-metrics"])
    assert args.metrics_port == 9090 and args.http_metrics is True


def test_help_shows_a_bad_variable_as_its_message_and_blank_is_unset(monkeypatch, capsys):
    """--help exits before a bad variable is refused; the flag's default then reads as the refusal
    (it printed a placeholder object's repr)."""
    monkeypatch.setenv("OPENJEV_GDN_SPLIT_AT", "abc")
    monkeypatch.setenv("OPENJEV_HTTP_METRICS", "  ")  # blank: as if unset, not a bad on/off word
    with pytest.raises(SystemExit) as exit_:
        config.parse_with_env(worker_parser(), ["--help"])
    assert exit_.value.code == 0
    assert "(default <environment variable OPENJEV_GDN_SPLIT_AT: " in " ".join(capsys.readouterr().out.split())
    assert config.parse_with_env(frontend_parser(), ["--model", "m"]).http_metrics is False


def test_a_message_size_past_grpcs_32_bits_is_refused_in_one_line(capsys):
    """gRPC's channel options are 32-bit: 2**31 passed the flag and ended the start in an
    OverflowError traceback from inside gRPC (a review helper's finding)."""
    assert frontend_parser().parse_args(["--model", "m", "--max-message-bytes", str(2**31 - 1)]).max_message_bytes
    with pytest.raises(SystemExit) as exit_:
        frontend_parser().parse_args(["--model", "m", "--max-message-bytes", str(2**31)])
    assert exit_.value.code == 2
    assert "--max-message-bytes: expected an integer from 1 to 2147483647" in capsys.readouterr().err


def test_a_connection_age_past_grpcs_32_bits_is_its_longest():
    """30 days (2.6e9 ms) passed the flag and, after the model loaded, ended the worker's start in a
    traceback: the age is capped at gRPC's longest, ~24.8 days."""
    options = dict(serving.server_options(serving.MAX_MESSAGE_BYTES, 30 * 24 * 3600.0))
    assert options["grpc.max_connection_age_ms"] == 2**31 - 1
    assert dict(serving.server_options(serving.MAX_MESSAGE_BYTES, 1.5))["grpc.max_connection_age_ms"] == 1500
    server = serving.build_server("127.0.0.1:0", lambda s: None, [], max_connection_age_seconds=30 * 24 * 3600.0)
    try:
        assert server.port > 0
    finally:
        server.grpc_server.stop(0)


def test_a_worker_tls_server_name_without_a_ca_is_refused():
    """The name the workers' certificates carry means nothing on a plaintext link: it was taken
    and ignored, where the CLI and the health check refuse the same combination."""
    with pytest.raises(security.SecurityError, match="--worker-tls-server-name need --worker-tls-ca"):
        security.channel_credentials(None, None, None, "worker.internal")
    assert security.channel_credentials(None, None, None, None) is None


def test_a_token_that_starts_with_a_hash_is_a_token_in_the_variable(tmp_path):
    """`#` comments are the token file's: in OPENJEV_AUTH_TOKENS such a token was dropped without a
    word, and its clients refused."""
    given = {"OPENJEV_AUTH_TOKENS": "first-token-aaaaaaaa,#second-token-bbbbbbbb"}
    assert security.load_tokens(None, given) == (b"first-token-aaaaaaaa", b"#second-token-bbbbbbbb")
    token_file = tmp_path / "tokens"
    token_file.write_text("# a comment\nfile-token-cccccccc\n  # an indented comment\n")
    assert security.load_tokens(token_file, {}) == (b"file-token-cccccccc",)
