"""The base install (frontend, client, CLI and the shared code) needs none of the worker's
dependencies: with torch, numpy and safetensors made unimportable, every module outside the
worker and the tools imports, and a frontend and the CLI answer the contract example through a
real worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from openjev.tools import launch

REPO = Path(__file__).resolve().parents[1]
WORKER_ONLY = ("torch", "numpy", "safetensors")
# Loaded at interpreter start (sitecustomize) so nothing can import them before it is in place.
BLOCKER = f"""
import importlib.abc, sys

class _WorkerOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {WORKER_ONLY!r}:
            raise ModuleNotFoundError(f"{{name}} is a worker dependency", name=name)
        return None

sys.meta_path.insert(0, _WorkerOnly())
"""


def blocked_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def test_shared_and_frontend_modules_import_without_worker_dependencies(tmp_path):
    code = f"""
import importlib, pkgutil, sys
import openjev, openjev.frontend
skip = ("openjev.worker", "openjev.tools", "openjev.kernels")
names = [m.name for m in pkgutil.walk_packages(openjev.__path__, "openjev.") if not m.name.startswith(skip)]
names += [m.name for m in pkgutil.walk_packages(openjev.frontend.__path__, "openjev.frontend.")]
names += ["openjev.tools.cli"]
for name in names:
    importlib.import_module(name)
assert not any(m.split(".")[0] in {WORKER_ONLY!r} for m in sys.modules)
print(" ".join(names))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], env=blocked_env(tmp_path), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    imported = set(done.stdout.split())
    expected = {"openjev.contract.request", "openjev.client", "openjev.frontend.main", "openjev.frontend.service"}
    assert expected <= imported
    check = subprocess.run(
        [sys.executable, "-c", "import torch"], env=blocked_env(tmp_path), capture_output=True, check=False
    )
    assert check.returncode != 0, "the blocker let torch through"


def test_frontend_and_cli_answer_without_worker_dependencies(pair, client, demo_model, tmp_path):
    env = blocked_env(tmp_path)
    frontend = launch.start(
        "frontend-base",
        launch.FRONTEND_MODULE,
        ["--model", str(demo_model), "--worker", pair.worker.address, "--plaintext"],
        workdir=tmp_path,
        env=env,
    )
    try:
        launch.wait_serving(frontend.address)
        request = REPO / "examples" / "contract_example.json"
        command = [sys.executable, "-m", "openjev.tools.cli", "decide", str(request), "--addr", frontend.address]
        done = subprocess.run([*command, "--policy", "off"], env=env, capture_output=True, text=True, check=False)
    finally:
        frontend.stop()
    assert done.returncode == 0, done.stderr
    want = client.decide(json.loads(request.read_text()), policy="off", timeout=60)
    assert json.loads(done.stdout)["answers"] == want["answers"]
