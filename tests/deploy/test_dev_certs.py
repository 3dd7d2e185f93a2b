"""The compose file's TLS settings, run for real without a container engine: certificates from
deploy/make-dev-certs.sh, a worker and a frontend started with exactly the TLS environment the
compose `cpu` services set (their /certs mount pointed at the script's folders), the health-check
command the containers run (with their OPENJEV_HEALTHCHECK_* variables), and a client over TLS;
and the plaintext override's environment, which must start both servers without certificates."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from openjev.client import Client
from openjev.tools import launch

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
EXAMPLE = json.loads((REPO / "examples" / "contract_example.json").read_text())


def tls_env(service: str, certs: Path) -> dict[str, str]:
    """The service's TLS variables, /certs replaced by its folder of `certs` (the name the
    frontend expects the workers' certificate to carry stays: the script's certificate has it)."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"][service]
    mount = next(v for v in compose["volumes"] if isinstance(v, dict) and v["target"] == "/certs")
    folder = certs / mount["source"].rsplit("/", 1)[1]
    env = {k: str(v) for k, v in compose["environment"].items() if "_TLS_" in k}
    return {k: str(folder / Path(v).name) if v.startswith("/certs/") else v for k, v in env.items()}


def plaintext_env(service: str) -> dict[str, str]:
    """What docker-compose.plaintext.yml leaves of the service's TLS settings: its own variables."""
    loader = type("ComposeLoader", (yaml.SafeLoader,), {})
    loader.add_constructor("!reset", lambda loader, node: None)
    loader.add_constructor("!override", lambda loader, node: loader.construct_sequence(node, deep=True))
    override = yaml.load((DEPLOY / "docker-compose.plaintext.yml").read_text(), Loader=loader)
    return {k: v for k, v in override["services"][service]["environment"].items() if v is not None}


def healthcheck(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OPENJEV_")}
    return subprocess.run(
        [sys.executable, "-m", "openjev.healthcheck", address],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def wait_healthy(address: str, env: dict[str, str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while (result := healthcheck(address, env)).returncode != 0:
        assert time.monotonic() < deadline, f"{address}: {result.stdout}{result.stderr}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def tls_stack(demo_model, tmp_path_factory):
    certs = tmp_path_factory.mktemp("certs")
    subprocess.run([str(DEPLOY / "make-dev-certs.sh"), str(certs)], check=True, capture_output=True)
    workdir = tmp_path_factory.mktemp("stack")
    worker_env, frontend_env = tls_env("worker-cpu", certs), tls_env("frontend-cpu", certs)
    # As in compose: the health check dials the worker at 127.0.0.1, the frontend at another
    # address its certificate does not name (there the container's IP; here 127.0.0.2).
    worker_args = ["--model", str(demo_model), "--listen", "0.0.0.0:0"]
    worker = launch.start("worker", launch.WORKER_MODULE, worker_args, workdir=workdir, env=worker_env)
    frontend = None
    try:
        wait_healthy(worker.address, worker_env)
        http = f"127.0.0.1:{launch.free_port()}"
        frontend = launch.start(
            "frontend",
            launch.FRONTEND_MODULE,
            ["--model", str(demo_model), "--worker", f"127.0.0.2:{worker.port}", "--http-listen", http],
            workdir=workdir,
            env=frontend_env,
        )
        wait_healthy(frontend.address, frontend_env)
        yield certs, worker, worker_env, frontend, frontend_env, http
    finally:
        if frontend is not None:
            frontend.stop()
        worker.stop()


def test_health_checks_pass_over_tls_and_fail_without_it(tls_stack):
    _certs, worker, worker_env, frontend, frontend_env, _http = tls_stack
    for address, env in ((worker.address, worker_env), (frontend.address, frontend_env)):
        ok = healthcheck(address, env)
        assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
        plain = healthcheck(address, {})
        assert (plain.returncode, plain.stdout.strip()) == (1, "UNAVAILABLE")
        # the cause on one line of stderr, not gRPC core's own log lines
        assert len(plain.stderr.splitlines()) == 1 and "failed to connect" in plain.stderr, plain.stderr
    # The name the check verifies, not the address it dials: the certificate names 127.0.0.1 and
    # `worker`, not 127.0.0.2 (a certificate from one's own CA need name no address at all).
    other = f"127.0.0.2:{worker.port}"
    assert worker_env["OPENJEV_HEALTHCHECK_TLS_SERVER_NAME"] == "worker"
    ok = healthcheck(other, worker_env)
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
    # The worker requires a client certificate: the CA alone is not enough.
    no_cert = healthcheck(worker.address, {"OPENJEV_HEALTHCHECK_TLS_CA": worker_env["OPENJEV_HEALTHCHECK_TLS_CA"]})
    assert (no_cert.returncode, no_cert.stdout.strip()) == (1, "UNAVAILABLE")
    assert len(no_cert.stderr.splitlines()) == 1, no_cert.stderr


def test_contract_example_over_tls_on_grpc_and_http(tls_stack):
    certs, _worker, _worker_env, frontend, _frontend_env, http = tls_stack
    credentials = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.crt").read_bytes())
    with Client(frontend.address, credentials) as client:
        answer = client.decide(EXAMPLE, timeout=60)
    assert list(answer["answers"]) == list(EXAMPLE["questions"])
    cli = subprocess.run(
        [sys.executable, "-m", "openjev.tools.cli", "decide", str(REPO / "examples" / "contract_example.json")]
        + ["--addr", frontend.address, "--tls-ca", str(certs / "ca.crt")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    assert list(json.loads(cli.stdout)["answers"]) == list(EXAMPLE["questions"])
    tls = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    reply = httpx.post(f"https://{http}/v1/systemone", json=EXAMPLE, timeout=60, verify=tls)
    assert reply.status_code == 200 and list(reply.json()["answers"]) == list(EXAMPLE["questions"])
    with pytest.raises(httpx.HTTPError):  # no plaintext on the TLS port
        httpx.post(f"http://{http}/v1/systemone", json=EXAMPLE, timeout=10)


def test_plaintext_override_starts_both_servers_without_certificates(demo_model, tmp_path):
    worker = launch.start(
        "worker", launch.WORKER_MODULE, ["--model", str(demo_model)], workdir=tmp_path, env=plaintext_env("worker-cpu")
    )
    frontend = None
    try:
        wait_healthy(worker.address, {})  # the health check with no TLS variable: plaintext
        frontend = launch.start(
            "frontend",
            launch.FRONTEND_MODULE,
            ["--model", str(demo_model), "--worker", worker.address],
            workdir=tmp_path,
            env=plaintext_env("frontend-cpu"),
        )
        wait_healthy(frontend.address, {})
        with Client(frontend.address) as client:
            assert list(client.decide(EXAMPLE, timeout=60)["answers"]) == list(EXAMPLE["questions"])
        assert '"event": "plaintext"' in frontend.log_text()  # the opt-in warns
    finally:
        if frontend is not None:
            frontend.stop()
        worker.stop()


def test_the_certificate_folders_are_readable_by_the_images_user_under_any_umask(tmp_path):
    """Under umask 077 the folders were 0700, root's: the images' user (uid 10001) could not read
    its key ("cannot read TLS key ... Permission denied" at start)."""
    certs = tmp_path / "certs"
    subprocess.run(
        ["sh", "-c", f'umask 077 && "{DEPLOY / "make-dev-certs.sh"}" "{certs}"'], check=True, capture_output=True
    )
    for folder in ("frontend", "worker"):
        assert (certs / folder).stat().st_mode & 0o777 == 0o755, folder
