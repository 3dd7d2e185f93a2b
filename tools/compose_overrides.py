"""deploy/'s override files through the real Compose loader (`docker compose config`, no engine
needed), in the combinations docs/deploy.md gives: each loads, and gives what it says. A YAML
reading cannot see how Compose resolves `extends` or merges lists: docker-compose.gpus.yml once
named a service of another file without `file:` and did not load, and with `file:` its worker
reserved GPU 0 as well as GPU 1 until `!override`.

    python -m openjev.tools.compose_overrides --compose .tools/bin/docker-compose
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def config(compose: str, files: list[str], profile: str) -> dict:
    args = [str(Path(compose).resolve()), *(a for f in files for a in ("-f", f)), "--profile", profile, "config"]
    out = subprocess.run(args, cwd=DEPLOY, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SystemExit(f"compose-overrides: {' + '.join(files)} does not load: {out.stderr.strip()}")
    return yaml.safe_load(out.stdout)["services"]


def uses_tls(service: dict) -> bool:
    """A certificate setting of the server, its health check or its calls to the workers."""
    return any("_TLS_" in var for var in service.get("environment", {}))


def mounts_certificates(service: dict) -> bool:
    return any(v.get("target") == "/certs" for v in service.get("volumes", []))


def makes_host_folders(service: dict) -> bool:
    """A bind that would create a missing host folder (empty, root's) instead of failing `up`."""
    return any(v["type"] == "bind" and v.get("bind", {}).get("create_host_path") for v in service.get("volumes", []))


def mounts_the_model(service: dict) -> bool:
    return any(v.get("target") == "/models/open-jev" for v in service.get("volumes", []))


def gpus(service: dict) -> list[str]:
    return [i for d in service["deploy"]["resources"]["reservations"]["devices"] for i in d["device_ids"]]


def check(compose: str) -> list[str]:
    """The problems found (empty: every combination as documented)."""
    problems = []
    base, plain = ["docker-compose.yml"], ["docker-compose.yml", "docker-compose.plaintext.yml"]
    extra = ["docker-compose.gpus.yml"]
    for profile in ("gpu", "cpu"):
        for name, s in config(compose, plain, profile).items():
            if uses_tls(s) or mounts_certificates(s):
                problems.append(f"plaintext override, {profile} profile: {name} still sets or mounts a certificate")
        for name, s in config(compose, base, profile).items():
            if makes_host_folders(s):
                problems.append(f"{profile} profile: {name} binds a host folder that `up` would create if missing")
    tls = config(compose, base + extra, "gpu")
    if gpus(tls["worker"]) != ["0"] or gpus(tls["worker-1"]) != ["1"]:
        problems.append(f"several GPUs: worker {gpus(tls['worker'])}, worker-1 {gpus(tls['worker-1'])}")
    if "worker" not in tls["worker-1"]["networks"]["default"]["aliases"]:
        problems.append("several GPUs: worker-1 lacks the network alias `worker`")
    both = config(compose, plain + extra + ["docker-compose.gpus.plaintext.yml"], "gpu")
    for name in ("worker", "worker-1"):
        plaintext = both[name]["environment"].get("OPENJEV_PLAINTEXT") == "1"
        if not plaintext or uses_tls(both[name]) or mounts_certificates(both[name]):
            problems.append(f"several GPUs in plaintext: {name} is not plaintext")
        if not mounts_the_model(both[name]):  # its volumes are the override's (`!override`)
            problems.append(f"several GPUs in plaintext: {name} does not mount the model")
    return problems


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compose-overrides", description=__doc__)
    p.add_argument("--compose", required=True, help="a Docker Compose v2 binary")
    return p


def main(argv: list[str] | None = None) -> int:
    problems = check(parser().parse_args(argv).compose)
    for problem in problems:
        print(f"compose-overrides: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
