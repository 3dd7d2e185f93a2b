"""`openjev decide` and `openjev.client.Client` against a frontend deployed as docs/deploy.md
describes: bearer tokens, mutual TLS on the public port, and a certificate that names only the
Service's DNS name (called by IP, with --tls-server-name). A real frontend on loopback (TLS,
--tls-client-ca, --auth-token-file) in front of the session's worker; the CLI as a subprocess;
certificates made at test time with `cryptography`. And --timeout values that could only fail."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

pytest.importorskip("cryptography")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from openjev.client import Client  # noqa: E402
from openjev.tools import launch  # noqa: E402

TOKEN = "cli-token-for-tests"
SERVICE_NAME = "openjev-frontend.openjev.svc"  # the only name on the frontend's certificate
SMALL = {"state": "hi", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}
UNAUTHENTICATED = "error: UNAUTHENTICATED: missing or invalid bearer token"


def _issue(root: Path, name: str, key, subject: str, issuer_key, issuer: str, dns: str | None) -> None:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=subject == issuer, path_length=None), critical=True)
    )
    if dns is not None:  # a DNS name only: no 127.0.0.1, no localhost
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    (root / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (root / f"{name}.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca.pem; server.pem naming only SERVICE_NAME; client.pem for mutual TLS; both from ca."""
    root = tmp_path_factory.mktemp("cli-pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    _issue(root, "ca", ca_key, "ca", ca_key, "ca", None)
    _issue(root, "server", ec.generate_private_key(ec.SECP256R1()), SERVICE_NAME, ca_key, "ca", SERVICE_NAME)
    _issue(root, "client", ec.generate_private_key(ec.SECP256R1()), "cli-client", ca_key, "ca", None)
    (root / "tokens").write_text(f"# the frontend's tokens\n\nother-token\n{TOKEN}\n")
    return root


def _credentials(pki: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes(),
        certificate_chain=(pki / "client.pem").read_bytes(),
    )


@pytest.fixture(scope="module")
def frontend(pair, demo_model, pki, tmp_path_factory):
    """TLS with a certificate for SERVICE_NAME only, client certificates required, bearer
    tokens; the worker link plaintext (the session's worker, on loopback)."""
    process = launch.start(
        "frontend-cli-auth",
        launch.FRONTEND_MODULE,
        [
            "--model", str(demo_model), "--worker", pair.worker.address, "--plaintext",
            "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
            "--tls-client-ca", str(pki / "ca.pem"), "--auth-token-file", str(pki / "tokens"),
        ],
        workdir=tmp_path_factory.mktemp("cli-auth"),
    )  # fmt: skip
    try:
        options = [("grpc.ssl_target_name_override", SERVICE_NAME)]
        launch.wait_serving(process.address, 60, credentials=_credentials(pki), options=options)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def request_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli-request") / "request.json"
    path.write_text(json.dumps(SMALL))
    return path


def _cli(*args: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OPENJEV_TOKEN"}
    if token is not None:
        env["OPENJEV_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "openjev.tools.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def _decide(frontend, pki, request_file, *flags: str, token: str | None = None, cert=True, name=True):
    """`openjev decide` against the frontend: by 127.0.0.1, trusting ca.pem; the client
    certificate and --tls-server-name unless left out."""
    args = ["decide", str(request_file), "--addr", frontend.address, "--tls-ca", str(pki / "ca.pem"), *flags]
    if cert:
        args += ["--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key")]
    if name:
        args += ["--tls-server-name", SERVICE_NAME]
    return _cli(*args, token=token)


def _answered(out: subprocess.CompletedProcess) -> bool:
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout)["answers"]) == ["q"]


def _refused(out: subprocess.CompletedProcess) -> str:
    """The one line a refused call prints (exit 1, no traceback)."""
    assert out.returncode == 1 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    [line] = out.stderr.strip().splitlines()
    return line


def test_token_from_the_environment_or_a_token_file_is_accepted(frontend, pki, request_file, tmp_path):
    assert _answered(_decide(frontend, pki, request_file, token=TOKEN))
    # the frontend's own token file (comments, a blank line): its first token; the file beats
    # the variable
    other = tmp_path / "other"
    other.write_text(f"# mine\n\n  {TOKEN}  \nignored\n")
    assert _answered(_decide(frontend, pki, request_file, "--token-file", str(other), token="wrong"))
    assert _answered(_decide(frontend, pki, request_file, "--token-file", str(pki / "tokens")))  # other-token


def test_a_wrong_or_missing_token_is_refused_unauthenticated(frontend, pki, request_file, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("# a token the frontend does not have\nnot-the-token\n")
    for flags, token in (((), None), ((), ""), ((), "wrong"), (("--token-file", str(wrong)), TOKEN)):
        out = _decide(frontend, pki, request_file, *flags, token=token)
        assert re.fullmatch(re.escape(UNAUTHENTICATED) + r" \(request id [0-9a-f]{32}\)", _refused(out)), (flags, token)
        assert TOKEN not in out.stderr


def test_mutual_tls_needs_the_client_certificate(frontend, pki, request_file):
    assert _answered(_decide(frontend, pki, request_file, token=TOKEN))
    assert _refused(_decide(frontend, pki, request_file, token=TOKEN, cert=False)).startswith("error: UNAVAILABLE: ")


def test_tls_server_name_verifies_a_certificate_for_another_name(frontend, pki, request_file):
    """The certificate names only SERVICE_NAME; the call dials 127.0.0.1."""
    assert _answered(_decide(frontend, pki, request_file, token=TOKEN))
    assert _refused(_decide(frontend, pki, request_file, token=TOKEN, name=False)).startswith("error: UNAVAILABLE: ")
    wrong = _decide(frontend, pki, request_file, "--tls-server-name", "elsewhere.example", token=TOKEN, name=False)
    assert _refused(wrong).startswith("error: UNAVAILABLE: ")


def test_client_sends_the_token_and_channel_options(frontend, pki):
    options = [("grpc.ssl_target_name_override", SERVICE_NAME)]
    with Client(frontend.address, _credentials(pki), token=TOKEN, options=options) as client:
        assert list(client.decide(SMALL, timeout=60, request_id="cli-auth-1")["answers"]) == ["q"]
    with Client(frontend.address, _credentials(pki), token="wrong", options=options) as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.decide(SMALL, timeout=60)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(ValueError, match="not printable ASCII"):  # gRPC would fail every call: INTERNAL
        Client(frontend.address, token="tok\u00e9n")


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-0", "-1", "1e309", "1e12"])
def test_timeout_must_be_a_positive_finite_number(value, request_file):
    """Each used to fail at once with DEADLINE_EXCEEDED (1e12 s overflows gRPC's deadline)."""
    out = _cli("decide", str(request_file), "--addr", "127.0.0.1:1", "--timeout", value)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert [line for line in out.stderr.splitlines() if "error" in line] == [out.stderr.strip().splitlines()[-1]]
    assert out.stderr.strip().splitlines()[-1].startswith("openjev decide: error: argument --timeout: ")


def test_client_flag_mistakes_are_one_line(request_file, pki, tmp_path):
    """Flags that go together: exit 2 (argparse); files that cannot be used, and a token that
    gRPC metadata cannot carry: exit 1. Neither shows a traceback or the token."""
    missing = tmp_path / "nope.pem"
    comments = tmp_path / "comments"
    comments.write_text("# no token yet\n\n")
    ca = ("--tls-ca", str(pki / "ca.pem"))
    cert, key = ("--tls-cert", str(pki / "client.pem")), ("--tls-key", str(pki / "client.key"))
    cases = [
        ((*ca, *cert), None, 2, "openjev decide: error: --tls-cert and --tls-key go together"),
        ((*ca, *key), None, 2, "openjev decide: error: --tls-cert and --tls-key go together"),
        ((*cert, *key), None, 2, "openjev decide: error: --tls-cert, --tls-key and --tls-server-name need --tls-ca"),
        (("--tls-server-name", "x"), None, 2, "openjev decide: error: --tls-cert, --tls-key and --tls-server-name"),
        ((*ca, "--tls-cert", str(missing), *key), None, 1, f"error: cannot read TLS certificate {missing}: No such"),
        ((*ca, *cert, "--tls-key", str(tmp_path)), None, 1, f"error: cannot read TLS key {tmp_path}: Is a directory"),
        (("--token-file", str(missing)), None, 1, f"error: cannot read auth token file {missing}: No such file"),
        (("--token-file", str(comments)), None, 1, f"error: auth token file {comments} holds no token"),
        ((), "s\u00e9cret", 1, "error: the token of $OPENJEV_TOKEN is not printable ASCII"),
        # files that are not what they say: one line naming them (gRPC's was a handshake failure)
        (("--tls-ca", str(pki / "client.key")), None, 2, "openjev decide: error: --tls-ca "),
        ((*ca, *cert, "--tls-key", str(pki / "server.key")), None, 2, "openjev decide: error: --tls-cert/--tls-key "),
    ]
    for flags, token, code, want in cases:
        out = _cli("decide", str(request_file), "--addr", "127.0.0.1:1", *flags, token=token)
        assert out.returncode == code and "Traceback" not in out.stderr, (flags, out.stderr)
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith(want), (flags, out.stderr)
        assert code == 2 or len(out.stderr.strip().splitlines()) == 1, (flags, out.stderr)
        assert "s\u00e9cret" not in out.stderr
