"""TLS on the public port, mutual TLS between frontend and worker, bearer tokens on the public API.
Real processes on loopback; certificates made at test time with `cryptography`."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytest.importorskip("cryptography")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from openjev.tools import launch  # noqa: E402
from openjev.tools.soak import log_events  # noqa: E402
from openjev.v1 import decision_pb2 as api  # noqa: E402
from openjev.v1 import decision_pb2_grpc  # noqa: E402
from openjev.worker.v1 import worker_pb2 as wire  # noqa: E402
from openjev.worker.v1 import worker_pb2_grpc  # noqa: E402

TOKEN = "s3cret-token-for-tests"
SMALL = {"state": "hi", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, issuer_key, issuer_name, key, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert=None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pki")
    files = {}
    for ca_name in ("ca", "other-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _cert(ca_name, ca_key, _name(ca_name), ca_key, ca=True)
        files[ca_name] = _write(root / f"{ca_name}.pem", cert=ca_cert)
        for leaf in ("server", "client"):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _cert(f"{ca_name}-{leaf}", ca_key, _name(ca_name), key, ca=False)
            files[f"{ca_name}-{leaf}"] = _write(root / f"{ca_name}-{leaf}.pem", cert=cert)
            files[f"{ca_name}-{leaf}-key"] = _write(root / f"{ca_name}-{leaf}.key", key=key)
    files["tokens"] = root / "tokens"
    files["tokens"].write_text(f"# tokens\n\nanother-token\n{TOKEN}\n")
    return files


def _creds(pki, client: str | None = None, ca: str = "ca") -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=pki[ca].read_bytes())
    return grpc.ssl_channel_credentials(
        root_certificates=pki[ca].read_bytes(),
        private_key=pki[f"{client}-key"].read_bytes(),
        certificate_chain=pki[client].read_bytes(),
    )


@pytest.fixture(scope="module")
def tls_pair(demo_model, pki, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tls")
    tls = ["--tls-cert", str(pki["ca-server"]), "--tls-key", str(pki["ca-server-key"])]
    worker = launch.start(
        "worker",
        launch.WORKER_MODULE,
        ["--model", str(demo_model), *tls, "--tls-client-ca", str(pki["ca"])],
        workdir=workdir,
    )
    frontend = None
    try:
        launch.wait_serving(worker.address, credentials=_creds(pki, "ca-client"))
        frontend = launch.start(
            "frontend",
            launch.FRONTEND_MODULE,
            [
                "--model", str(demo_model), "--worker", worker.address, *tls,
                "--auth-token-file", str(pki["tokens"]),
                "--worker-tls-ca", str(pki["ca"]),
                "--worker-tls-cert", str(pki["ca-client"]), "--worker-tls-key", str(pki["ca-client-key"]),
            ],
            workdir=workdir,
        )  # fmt: skip
        launch.wait_serving(frontend.address, credentials=_creds(pki))
        yield worker, frontend
    finally:
        if frontend is not None:
            frontend.stop()
        worker.stop()


def _decide(address, credentials, metadata=None):
    with grpc.secure_channel(address, credentials) as channel:
        stub = decision_pb2_grpc.DecisionServiceStub(channel)
        return stub.Decide(api.DecideRequest(request_json=json.dumps(SMALL)), timeout=30, metadata=metadata)


def test_tls_and_bearer_token_on_the_public_port(tls_pair, pki):
    _worker, frontend = tls_pair
    reply = _decide(frontend.address, _creds(pki), [("authorization", f"Bearer {TOKEN}")])
    assert reply.answers[0].question_id == "q"
    twice = [("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer wrong")]
    other_schemes = [[("authorization", f"{scheme} {TOKEN}")] for scheme in ("Basic", "Token", "Bearer-ish")]
    for metadata in (
        None,
        [("authorization", "Bearer wrong")],
        [("authorization", TOKEN)],
        twice,
        twice[::-1],
        *other_schemes,
    ):
        with pytest.raises(grpc.RpcError) as caught:
            _decide(frontend.address, _creds(pki), metadata)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert caught.value.details() == "missing or invalid bearer token"
        assert dict(caught.value.trailing_metadata() or ()).get("x-request-id")  # made up: none was sent
    with pytest.raises(grpc.RpcError) as caught:
        _decide(frontend.address, _creds(pki), [("x-request-id", "refused-1")])
    assert dict(caught.value.trailing_metadata() or ()).get("x-request-id") == "refused-1"
    # a refusal leaves a trail in the log, as the HTTP route's 401s do
    refused = [json.loads(line) for line in frontend.log_text().splitlines() if '"refused-1"' in line]
    assert any(r["event"] == "refused" and r["status"] == "UNAUTHENTICATED" for r in refused), refused
    assert all(r["peer"].startswith(("ipv4:127.0.0.1:", "ipv6:[::1]:")) for r in refused if r["event"] == "refused")
    with grpc.insecure_channel(frontend.address) as channel, pytest.raises(grpc.RpcError) as caught:
        decision_pb2_grpc.DecisionServiceStub(channel).Decide(api.DecideRequest(request_json="{}"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # no plaintext on a TLS port
    assert TOKEN not in frontend.log_text()


@pytest.mark.parametrize("sent", [None, "A" * 3000, "a b c", "described-1"], ids=["none", "long", "spaces", "valid"])
def test_a_refused_describe_model_carries_a_valid_request_id(tls_pair, pki, sent):
    """DescribeModel passes no interceptor that checks or makes request ids: its refusal carried
    none, or echoed (and logged) whatever the caller sent, 3,000 characters or spaces included."""
    _worker, frontend = tls_pair
    metadata = None if sent is None else [("x-request-id", sent)]
    with grpc.secure_channel(frontend.address, _creds(pki)) as channel, pytest.raises(grpc.RpcError) as caught:
        decision_pb2_grpc.DecisionServiceStub(channel).DescribeModel(
            api.DescribeModelRequest(), timeout=10, metadata=metadata
        )
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    given = dict(caught.value.trailing_metadata() or ()).get("x-request-id")
    if sent == "described-1":
        assert given == sent
    else:
        assert given is not None and re.fullmatch("[0-9a-f]{32}", given), given
    lines = [json.loads(line) for line in frontend.log_text().splitlines() if given in line]
    assert any(line["event"] == "refused" and line["method"].endswith("/DescribeModel") for line in lines)


def test_failed_handshakes_leave_no_plain_text_lines_in_the_logs(tls_pair):
    """gRPC's C core wrote a plain-text INFO line to stderr for every failed TLS handshake, which
    any peer can cause (junk on the port): unthrottled, among the servers' JSON lines."""
    for process in tls_pair:
        host, port = process.address.rsplit(":", 1)
        for _ in range(20):
            with socket.create_connection((host, int(port)), timeout=5) as junk:
                junk.sendall(b"GET / HTTP/1.1\r\n\r\n")
                junk.recv(100)  # the server's alert or close: the handshake has failed
    time.sleep(0.5)
    for process in tls_pair:
        for line in process.log_text().splitlines():
            json.loads(line)  # a server's log lines are JSON, one object a line


def test_worker_requires_a_client_certificate_from_its_ca(tls_pair, pki):
    worker, _frontend = tls_pair
    with grpc.secure_channel(worker.address, _creds(pki, "ca-client")) as channel:
        assert worker_pb2_grpc.WorkerServiceStub(channel).Describe(wire.DescribeRequest(), timeout=10).model_id
    for credentials in (_creds(pki), _creds(pki, "other-ca-client")):
        with grpc.secure_channel(worker.address, credentials) as channel, pytest.raises(grpc.RpcError) as caught:
            worker_pb2_grpc.WorkerServiceStub(channel).Describe(wire.DescribeRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def _start_fails(module: str, args: list[str]) -> str:
    """Run a server that must refuse to start; its last stderr line (earlier ones: the config log)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENJEV_PLAINTEXT"}
    done = subprocess.run(
        [sys.executable, "-m", module, *args, "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and '"listening"' not in done.stderr and '"serving"' not in done.stderr
    return done.stderr.strip().splitlines()[-1]


PLAINTEXT_HINT = "pass --plaintext (or OPENJEV_PLAINTEXT=1) to run it in plaintext"


def test_no_certificates_and_no_plaintext_flag_refuses_to_start(demo_model, pki):
    model = ["--model", str(demo_model)]
    assert _start_fails(launch.WORKER_MODULE, model) == (
        "openjev-worker: the worker port has no TLS certificate (set --tls-cert and --tls-key, and "
        f"--tls-client-ca for mutual TLS); {PLAINTEXT_HINT}"
    )
    assert _start_fails(launch.FRONTEND_MODULE, [*model, "--worker", "127.0.0.1:1"]) == (
        f"openjev-frontend: the public port has no TLS certificate (set --tls-cert and --tls-key); {PLAINTEXT_HINT}"
    )
    # TLS on the public port does not make the frontend's connection to its workers plaintext silently
    tls = ["--tls-cert", str(pki["ca-server"]), "--tls-key", str(pki["ca-server-key"])]
    assert _start_fails(launch.FRONTEND_MODULE, [*model, "--worker", "127.0.0.1:1", *tls]) == (
        "openjev-frontend: the connection to the workers has no TLS certificate (set --worker-tls-ca, and "
        f"--worker-tls-cert and --worker-tls-key for mutual TLS); {PLAINTEXT_HINT}"
    )


def test_a_certificate_and_key_that_do_not_go_together_refuse_at_once(demo_model, pki):
    """gRPC checks them only when the port is bound: the worker had loaded its weights by then and
    said the address was in use. A CA file that is no certificate left the frontend NOT_SERVING."""
    mismatched = ["--tls-cert", str(pki["ca-server"]), "--tls-key", str(pki["ca-client-key"])]
    line = _start_fails(launch.WORKER_MODULE, ["--model", str(demo_model), *mismatched])
    assert line.startswith(f"openjev-worker: --tls-cert/--tls-key {pki['ca-server']} and {pki['ca-client-key']}: ")
    assert "not a PEM certificate and its unencrypted private key" in line
    tls = ["--tls-cert", str(pki["ca-server"]), "--tls-key", str(pki["ca-server-key"])]
    not_a_ca = ["--worker-tls-ca", str(pki["ca-client-key"])]
    line = _start_fails(
        launch.FRONTEND_MODULE, ["--model", str(demo_model), "--worker", "127.0.0.1:1", *tls, *not_a_ca]
    )
    assert line.startswith(f"openjev-frontend: --worker-tls-ca {pki['ca-client-key']}: not a PEM CA certificate")


def test_an_encrypted_key_is_refused_as_one(pki, tmp_path):
    """The refusal ended in "(None)": an encrypted key's error has no reason."""
    from openjev import security

    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert("enc", key, _name("enc"), key, ca=False)
    encrypted = serialization.BestAvailableEncryption(b"passphrase")
    key_file = tmp_path / "enc.key"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encrypted))
    with pytest.raises(security.SecurityError) as refused:
        security._check_pair(_write(tmp_path / "enc.pem", cert=cert), key_file, "--tls-cert/--tls-key")
    assert str(refused.value).endswith("its unencrypted private key (the key is encrypted)"), refused.value


def _plaintext_warnings(log_text: str) -> list[dict]:
    return [r for r in log_events(log_text, "plaintext") if r.get("level") == "warning"]


def test_plaintext_when_asked_for_logs_a_warning(demo_model, pair, tmp_path):
    # the flag (the pair fixture's worker) and the environment variable (this frontend)
    assert len(_plaintext_warnings(pair.worker.log_text())) == 1
    frontend = launch.start(
        "frontend-env",
        launch.FRONTEND_MODULE,
        ["--model", str(demo_model), "--worker", "127.0.0.1:1"],
        workdir=tmp_path,
        env={"OPENJEV_PLAINTEXT": "1"},
    )
    try:
        with grpc.insecure_channel(frontend.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # plaintext, and no worker yet
    finally:
        frontend.stop()
    assert sorted(r["port"] for r in _plaintext_warnings(frontend.log_text())) == ["public", "worker"]


def test_tokens_asked_for_but_none_given_refuses_to_start(demo_model, tmp_path):
    """A token file of comments only, or a token variable of separators, would have left the
    port open without a word: the frontend refuses to start instead."""
    comments = tmp_path / "tokens"
    comments.write_text("# the real tokens go here\n\n")
    base = ["--model", str(demo_model), "--worker", "127.0.0.1:1", "--plaintext"]
    assert _start_fails(launch.FRONTEND_MODULE, [*base, "--auth-token-file", str(comments)]) == (
        f"openjev-frontend: auth token file {comments} holds no token (only blank lines, separators or # comments)"
    )
    env = {**os.environ, "OPENJEV_AUTH_TOKENS": " , "}
    done = subprocess.run(
        [sys.executable, "-m", launch.FRONTEND_MODULE, *base, "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        "openjev-frontend: $OPENJEV_AUTH_TOKENS holds no token (only blank lines, separators or # comments)"
    )


def test_a_worker_with_tls_but_no_client_ca_warns(demo_model, pki, tmp_path):
    worker = launch.start(
        "worker-no-client-ca",
        launch.WORKER_MODULE,
        ["--model", str(demo_model), "--tls-cert", str(pki["ca-server"]), "--tls-key", str(pki["ca-server-key"])],
        workdir=tmp_path,
    )
    try:  # logged before the model loads, so before the port file: one warning
        [warning] = log_events(worker.log_text(), "no_client_auth")
        assert warning["level"] == "warning" and "--tls-client-ca" in warning["hint"]
    finally:
        worker.stop()
