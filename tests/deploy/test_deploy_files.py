"""No container engine runs here, so deploy/ is checked by reading it: the compose file and the
Kubernetes manifests parse, and every entry point, flag, environment variable and port they name
is one the servers really have; the images run the same entry modules the tests start; and the
health-check command they use works against a real server."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from openjev import healthcheck
from openjev.config import env_name
from openjev.frontend.main import parser as frontend_parser
from openjev.frontend.worker_targets import parse_worker_targets
from openjev.tools import launch
from openjev.worker.main import parser as worker_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PARSERS = {launch.WORKER_MODULE: worker_parser(), launch.FRONTEND_MODULE: frontend_parser()}
ENTRY = {"worker": launch.WORKER_MODULE, "frontend": launch.FRONTEND_MODULE}


def flags(module: str) -> set[str]:
    return {o for a in PARSERS[module]._actions for o in a.option_strings if o.startswith("--")}


def env_vars(module: str) -> set[str]:
    return {env_name(a.dest) for a in PARSERS[module]._actions if a.option_strings and a.dest != "help"}


def check_args(module: str, args: list[str]) -> None:
    """The flags exist, and the arguments parse (required ones supplied by OPENJEV_MODEL)."""
    for arg in args:
        if arg.startswith("--"):
            assert arg.split("=")[0] in flags(module), f"{module} has no flag {arg}"
    PARSERS[module].parse_args(["--model", "/models/open-jev", *args])


def dockerfile(name: str) -> dict:
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / f"{name}.Dockerfile").read_text())  # join continued lines
    instructions = {}
    for match in re.finditer(r"^(ENTRYPOINT|CMD|USER|EXPOSE|HEALTHCHECK)\s+(.*)$", text, re.M):
        instructions.setdefault(match.group(1), match.group(2).strip())
    env = dict(re.findall(r"(OPENJEV_[A-Z_]+)=(\S+)", text))
    return {"text": text, "env": env, **instructions}


@pytest.mark.parametrize("name", ["worker", "worker-cpu", "frontend"])
def test_images_run_the_tested_entry_points_as_non_root(name):
    image = dockerfile(name)
    entry = ENTRY[name.split("-")[0]]
    assert json.loads(image["ENTRYPOINT"]) == ["python", "-m", entry]
    assert image["USER"].split(":")[0] not in ("0", "root")
    assert set(image["env"]) <= env_vars(entry)
    listen_port = image["env"]["OPENJEV_LISTEN"].rsplit(":", 1)[1]
    http_port = (
        {image["env"]["OPENJEV_HTTP_LISTEN"].rsplit(":", 1)[1]} if "OPENJEV_HTTP_LISTEN" in image["env"] else set()
    )
    assert set(image["EXPOSE"].split()) == {listen_port, image["env"]["OPENJEV_METRICS_PORT"], *http_port}
    health = image["HEALTHCHECK"].split("CMD", 1)[1]
    assert json.loads(health.strip()) == ["python", "-m", "openjev.healthcheck", f"127.0.0.1:{listen_port}"]


def context_admits() -> set[str]:
    """The top-level names .dockerignore lets into the build context: it excludes everything
    (`*`) and then admits names one by one (`!name`)."""
    rules = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    rules = [rule for rule in rules if rule and not rule.startswith("#")]
    assert rules[0] == "*", "a whitelist: `COPY . ./` must not take what is not listed"
    return {rule[1:] for rule in rules if rule.startswith("!")}


# the tracing extra too: --otlp-endpoint, which deploy.md offers on both servers, needs it
@pytest.mark.parametrize(("name", "requirement"), [("frontend", '".[tracing]"'), ("worker", '".[cuda,tracing]"')])
def test_images_install_the_distribution_through_its_extras(name, requirement):
    """A regular install (no -e, no source tree needed afterwards) of every package folder the
    distribution maps, with dependencies from pyproject.toml only: the frontend the base install,
    the worker the cuda extra; both the tracing extra."""
    text = dockerfile(name)["text"]
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert re.findall(r"^COPY .*$", text, re.M) == ["COPY . ./"]  # one layer: a full copy each on vfs
    assert {*package_dirs.values(), "pyproject.toml", "README.md"} <= context_admits()
    installs = [command.strip() for command in re.findall(r"pip install ([^&\n]+)", text)]
    assert installs == [requirement]


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


RESET = object()


class ComposeLoader(yaml.SafeLoader):
    """Compose's merge tags: `!reset` removes what the file before it set."""


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
# `!override` replaces what the file before it set (a list Compose would otherwise append to)
ComposeLoader.add_constructor("!override", lambda loader, node: loader.construct_sequence(node, deep=True))
# Read by the health check in each container, not by the server.
HEALTHCHECK_ENV = {healthcheck.ENV_PREFIX + flag.upper() for flag in healthcheck.TLS_FLAGS}
# The servers' plaintext opt-in (--plaintext).
PLAINTEXT_ENV = "OPENJEV_PLAINTEXT"
TLS_ENV = {
    launch.WORKER_MODULE: {"OPENJEV_TLS_CERT", "OPENJEV_TLS_KEY", "OPENJEV_TLS_CLIENT_CA"},
    launch.FRONTEND_MODULE: {
        "OPENJEV_TLS_CERT",
        "OPENJEV_TLS_KEY",
        "OPENJEV_WORKER_TLS_CA",
        "OPENJEV_WORKER_TLS_CERT",
        "OPENJEV_WORKER_TLS_KEY",
        "OPENJEV_WORKER_TLS_SERVER_NAME",
    },
}
SERVICES = {"worker": "worker", "worker-cpu": "worker", "frontend": "frontend", "frontend-cpu": "frontend"}


def mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of each volume, short or long syntax."""
    found = []
    for volume in service["volumes"]:
        if isinstance(volume, dict):
            found.append((volume["source"], volume["target"], volume.get("read_only", False)))
        else:  # SOURCE:TARGET[:MODE], where SOURCE may hold a ${VAR:-default} colon
            parts = volume.split(":")
            mode = parts.pop() if parts[-1] in ("ro", "rw") else "rw"
            found.append((":".join(parts[:-1]), parts[-1], mode == "ro"))
    return found


def test_a_missing_host_folder_is_not_made_empty():
    """Compose's short bind syntax creates a missing host folder (empty, root's): the GPU worker
    then restarted until `up` gave up after its start period, and a certificate folder made so
    could not be filled by make-dev-certs.sh afterwards. Every host folder bound must exist."""
    services = compose()["services"]
    for name in ("worker", "frontend"):
        bind = next(v for v in services[name]["volumes"] if isinstance(v, dict) and v["target"] == "/models/open-jev")
        assert bind["type"] == "bind" and bind["read_only"], name
    binds = 0
    for name, service in services.items():
        for volume in service.get("volumes", []):
            # a short entry names a host path (./, /, $) or a named volume (demo-model:/models)
            assert isinstance(volume, dict) or not volume.startswith((".", "/", "$")), (name, volume)
            if isinstance(volume, dict) and volume["type"] == "bind":
                assert volume["bind"] == {"create_host_path": False}, (name, volume)
                binds += 1
    assert binds == 6  # the model (GPU worker, frontend) and the certificates (all four services)


def test_compose_brings_up_worker_then_frontend_healthy():
    services = compose()["services"]
    for frontend, worker in (("frontend", "worker"), ("frontend-cpu", "worker-cpu")):
        f, w = services[frontend], services[worker]
        assert f["depends_on"] == {worker: {"condition": "service_healthy"}}
        assert set(f["profiles"]) == set(w["profiles"])
        for service, module in ((f, launch.FRONTEND_MODULE), (w, launch.WORKER_MODULE)):
            assert set(service["environment"]) <= env_vars(module) | HEALTHCHECK_ENV
            listen_port = service["environment"]["OPENJEV_LISTEN"].rsplit(":", 1)[1]
            assert service["healthcheck"]["test"] == [
                "CMD",
                "python",
                "-m",
                "openjev.healthcheck",
                f"127.0.0.1:{listen_port}",
            ]
            assert service["build"]["dockerfile"] in (
                "deploy/worker.Dockerfile",
                "deploy/worker-cpu.Dockerfile",
                "deploy/frontend.Dockerfile",
            )
            assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).exists()
            model_dir = service["environment"]["OPENJEV_MODEL"]
            assert any(read_only and model_dir.startswith(target) for _, target, read_only in mounts(service))
        # The HTTP API is on in compose, on a published port.
        http_port = f["environment"]["OPENJEV_HTTP_LISTEN"].rsplit(":", 1)[1]
        assert any(str(p).endswith(f":{http_port}") for p in f["ports"])
        # The frontend reaches every worker under the name they share.
        target = parse_worker_targets(f["environment"]["OPENJEV_WORKER"])
        assert target.traffic_target.startswith("dns:///")
        assert target.name in w["networks"]["default"]["aliases"]
        assert str(target.port) == w["environment"]["OPENJEV_LISTEN"].rsplit(":", 1)[1]


def test_compose_gpu_reservation_and_cpu_demo_profile():
    services = compose()["services"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    assert "deploy" not in services["worker-cpu"]
    assert (
        services["worker-cpu"]["environment"]["OPENJEV_BACKEND"]
        in worker_parser()._option_string_actions["--backend"].choices
    )
    builder = services["demo-model"]
    assert builder["entrypoint"] == ["python", "-m", "openjev.tools.demo_model"]
    assert services["worker-cpu"]["depends_on"] == {"demo-model": {"condition": "service_completed_successfully"}}
    assert (DEPLOY / ".env").read_text().count("COMPOSE_PROFILES=gpu") == 1
    # how Compose resolves and merges these is checked with its loader: tools/compose_overrides.py
    extra = yaml.load((DEPLOY / "docker-compose.gpus.yml").read_text(), Loader=ComposeLoader)["services"]
    assert all(s["extends"] == {"file": "docker-compose.yml", "service": "worker"} for s in extra.values())
    plain = yaml.load((DEPLOY / "docker-compose.gpus.plaintext.yml").read_text(), Loader=ComposeLoader)["services"]
    assert set(plain) == set(extra), "a plaintext block for every worker of docker-compose.gpus.yml"


def k8s_documents() -> list[dict]:
    docs = []
    for name in yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
    return docs


def pod_volumes(by_kind: dict) -> list[dict]:
    return [
        v for d in by_kind.values() if "template" in d.get("spec", {}) for v in d["spec"]["template"]["spec"]["volumes"]
    ]


def test_kubernetes_manifests():
    docs = k8s_documents()
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    worker = by_kind[("StatefulSet", "openjev-worker")]["spec"]["template"]["spec"]["containers"][0]
    frontend = by_kind[("Deployment", "openjev-frontend")]["spec"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": 1}
    # requests (not BestEffort: the first pods a busy node evicts) and the "restricted" Pod
    # Security Standard's settings, which a namespace enforcing it requires
    for kind, name in (("StatefulSet", "openjev-worker"), ("Deployment", "openjev-frontend")):
        pod = by_kind[(kind, name)]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}, name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
    scratch = [v["emptyDir"] for v in pod_volumes(by_kind) if "emptyDir" in v]
    assert scratch and all("sizeLimit" in v for v in scratch)  # the worker's /tmp (CuPy's cache)
    check_args(launch.WORKER_MODULE, worker["args"][2:])
    check_args(launch.FRONTEND_MODULE, frontend["args"][2:])
    for container in (worker, frontend):
        args = dict(zip(container["args"][::2], container["args"][1::2], strict=True))
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert args["--listen"] == f"0.0.0.0:{ports['grpc']}"
        assert int(args["--metrics-port"]) == ports["metrics"]
        assert all(m["readOnly"] for m in container["volumeMounts"] if m["mountPath"] == "/models/open-jev")
    service = by_kind[("Service", "openjev-worker")]["spec"]
    assert service["clusterIP"] == "None"  # headless: DNS answers every ready worker
    target = parse_worker_targets(dict(zip(frontend["args"][::2], frontend["args"][1::2], strict=True))["--worker"])
    assert target.name == "openjev-worker" and target.port == service["ports"][0]["port"]


@pytest.mark.parametrize(("kind", "name"), [("StatefulSet", "openjev-worker"), ("Deployment", "openjev-frontend")])
def test_kubernetes_tls_from_a_secret_and_probes_over_tls(kind, name):
    """TLS flags name files of a Secret mounted read-only; the probes run the health check over
    TLS against the gRPC port, trusting the same CA, naming the certificate's Service name."""
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in k8s_documents()}
    pod = by_kind[(kind, name)]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    module = launch.WORKER_MODULE if kind == "StatefulSet" else launch.FRONTEND_MODULE
    args = dict(zip(container["args"][::2], container["args"][1::2], strict=True))
    tls = {flag for flag in args if "tls" in flag}
    assert {env_name(flag[2:].replace("-", "_")) for flag in tls} == TLS_ENV[module]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
    files = tls - {"--worker-tls-server-name"}
    assert mount["readOnly"] and all(args[flag].startswith(mount["mountPath"] + "/") for flag in files)
    if module == launch.FRONTEND_MODULE:  # each worker pod is probed by IP: the certificate's name is set
        assert args["--worker-tls-server-name"] == parse_worker_targets(args["--worker"]).name
    secret = next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]
    assert secret["secretName"] == f"{name}-tls" and secret["defaultMode"] == 0o440
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]  # the key is readable
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in container]
    assert "readinessProbe" in container
    for probe in probes:
        if "tcpSocket" in probe:
            assert probe["tcpSocket"]["port"] == ports["grpc"]
            continue
        command = probe["exec"]["command"]
        assert command[:3] == ["python", "-m", "openjev.healthcheck"]
        parsed = healthcheck.parser().parse_args(command[3:])
        assert parsed.address == f"127.0.0.1:{ports['grpc']}"
        assert str(parsed.tls_ca) == args.get("--tls-client-ca", args.get("--worker-tls-ca"))
        assert parsed.tls_server_name == name  # the Service name the certificate carries
        if module == launch.WORKER_MODULE:  # mTLS: the probe presents a certificate
            assert (str(parsed.tls_cert), str(parsed.tls_key)) == (args["--tls-cert"], args["--tls-key"])
        assert probe["timeoutSeconds"] > parsed.timeout


def test_compose_serves_tls_with_mounted_certificates():
    """Both profiles: the frontend serves TLS and dials workers with a client certificate, the
    workers require one; every certificate path lies in a read-only mount at /certs of that
    process's own folder of OPENJEV_CERTS_DIR; the health checks speak TLS with the same files."""
    services = compose()["services"]
    for name, process in SERVICES.items():
        service = services[name]
        module = ENTRY[process]
        env = service["environment"]
        assert TLS_ENV[module] <= set(env)
        assert (f"${{OPENJEV_CERTS_DIR:-./certs}}/{process}", "/certs", True) in mounts(service)
        paths = [env[k] for k in TLS_ENV[module] | (HEALTHCHECK_ENV & set(env)) if not k.endswith("_SERVER_NAME")]
        assert all(path.startswith("/certs/") for path in paths)
        if process == "frontend":  # each worker is probed by IP: the certificate's name is set
            worker = services[name.replace("frontend", "worker")]
            assert env["OPENJEV_WORKER_TLS_SERVER_NAME"] in worker["networks"]["default"]["aliases"]
        assert env["OPENJEV_HEALTHCHECK_TLS_CA"] == env.get("OPENJEV_TLS_CLIENT_CA", env.get("OPENJEV_WORKER_TLS_CA"))
        if process == "worker":
            assert env["OPENJEV_HEALTHCHECK_TLS_CERT"] == env["OPENJEV_TLS_CERT"]


def test_compose_plaintext_override_removes_every_tls_setting():
    """`-f docker-compose.plaintext.yml`: the same services with no certificate setting left and
    the plaintext opt-in set, so no process is half on TLS."""
    base = compose()["services"]
    override = yaml.load((DEPLOY / "docker-compose.plaintext.yml").read_text(), Loader=ComposeLoader)["services"]
    assert set(override) == set(SERVICES)
    for name, process in SERVICES.items():
        env = override[name]["environment"]
        reset = {k for k, v in env.items() if v is RESET}
        assert reset == {k for k in base[name]["environment"] if k in TLS_ENV[ENTRY[process]] | HEALTHCHECK_ENV}
        assert {k: v for k, v in env.items() if v is not RESET} == {PLAINTEXT_ENV: "1"}
        assert PLAINTEXT_ENV in env_vars(ENTRY[process])
        # its volumes replace the base's (`!override`): the model's alone, no certificate folder
        assert mounts(override[name]) == [m for m in mounts(base[name]) if m[1] != "/certs"], name


def test_dev_certificate_script_layout(tmp_path):
    """deploy/make-dev-certs.sh: one folder per process in a Kubernetes TLS Secret's layout, each
    certificate signed by the CA and naming the compose and Kubernetes names (the running check
    is tests/deploy/test_dev_certs.py)."""
    subprocess.run([str(DEPLOY / "make-dev-certs.sh"), str(tmp_path), "10.1.2.3"], check=True, capture_output=True)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "ca.crt", "frontend/ca.crt", "frontend/tls.crt", "frontend/tls.key",
        "worker/ca.crt", "worker/tls.crt", "worker/tls.key",
    ]  # fmt: skip
    for process, names in (("frontend", ["frontend", "openjev-frontend"]), ("worker", ["worker", "openjev-worker"])):
        show = ["openssl", "x509", "-noout", "-ext", "subjectAltName,extendedKeyUsage"]
        text = subprocess.run(
            [*show, "-in", str(tmp_path / process / "tls.crt")], check=True, capture_output=True, text=True
        ).stdout
        assert all(f"DNS:{n}," in text or text.rstrip().endswith(f"DNS:{n}") for n in names)
        assert "IP Address:127.0.0.1" in text and "IP Address:10.1.2.3" in text
        assert "TLS Web Server Authentication, TLS Web Client Authentication" in text


def test_compose_commands_parse():
    """Every flag-bearing command in compose parses with the server's own parser."""
    services = compose()["services"]
    for name in ("worker", "worker-cpu", "frontend", "frontend-cpu"):
        command = services[name].get("command", [])
        check_args(ENTRY[name.split("-")[0]], shlex.split(command) if isinstance(command, str) else command)


def test_healthcheck_command_against_real_servers(pair):
    """The exact command the images' health checks run: 0 when SERVING, 1 when not."""
    for address in (pair.worker.address, pair.frontend.address):
        ok = subprocess.run(
            [sys.executable, "-m", "openjev.healthcheck", address], capture_output=True, text=True, timeout=60
        )
        assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING"), ok.stderr
    down = subprocess.run(
        [sys.executable, "-m", "openjev.healthcheck", f"127.0.0.1:{launch.free_port()}", "--timeout", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 1


@pytest.mark.parametrize("finished", [True, False])
def test_base_image_build_removes_a_finished_filesystem_when_the_image_exists(tmp_path, finished):
    """CI hands build.sh the filesystem it made beside `make test`; with the image already there
    nothing imports it, and it was left behind (a Debian root filesystem in /var/tmp). One still
    being made (no .done marker) is not touched."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text("#!/bin/sh\nexit 0\n")  # `docker image inspect TAG`: it exists
    (fake / "docker").chmod(0o755)
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    if finished:
        (tmp_path / "rootfs.done").touch()
    env = {"PATH": f"{fake}:/usr/bin:/bin"}
    out = subprocess.run(
        ["bash", str(DEPLOY / "base-image" / "build.sh"), "openjev-base:test", str(rootfs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "exists" in out.stdout
    assert rootfs.exists() is not finished
    assert not (tmp_path / "rootfs.done").exists()
