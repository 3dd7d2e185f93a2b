"""The built wheel, installed into a fresh environment (no editable install, no source tree on
the path), serves the contract example with the editable install's answers.

The base install (no extras) is the frontend, the client and the CLI: torch is not installed in
that environment at all. The fast test runs the worker from the same installed package with the
worker's third-party dependencies (torch, numpy, safetensors) lent by the test's own environment
on PYTHONPATH, because installing torch takes minutes; the slow test installs `[worker]` for real.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from test_end_to_end import EXAMPLE, assert_answers_close, reference_answers

from openjev.tools import launch

REPO = Path(__file__).resolve().parents[1]
KERNELS = sorted(path.name for path in (REPO / "cuda").glob("*.cu"))
# What the wheel is built from; everything else (venvs, caches, results) stays behind.
SOURCES = ("pyproject.toml", "README.md", "common", "frontend", "worker", "tools", "cuda")


def _run(*command: str | Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    done = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (setuptools writes build/ beside them)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", root / "dist", source)
    (built,) = (root / "dist").glob("openjev_serve-*.whl")
    return built


def _fresh_env(path: Path, requirement: str) -> Path:
    """A new virtual environment (no system site-packages) with `requirement` installed; its python.
    Not byte-compiled at install (as `make` installs): its few processes compile what they import."""
    venv.create(path, with_pip=True)
    python = path / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", "--no-compile", requirement)
    return python


@pytest.fixture(scope="module")
def base_env(wheel, tmp_path_factory) -> Path:
    return _fresh_env(tmp_path_factory.mktemp("base-env") / "venv", str(wheel))


def _answers_through_cli(python: Path, demo_model: Path, workdir: Path, worker_env: dict[str, str] | None) -> dict:
    """Worker and frontend started from `python`'s environment; the example sent with its CLI."""
    worker = launch.start(
        "worker",
        launch.WORKER_MODULE,
        ["--model", str(demo_model), "--plaintext"],
        workdir=workdir,
        python=python,
        env=worker_env,
    )
    try:
        launch.wait_serving(worker.address)
        frontend = launch.start_frontend(demo_model, worker.address, workdir, python=python)
        try:
            launch.wait_serving(frontend.address)
            cli = python.parent / "openjev"
            out = _run(
                cli,
                "decide",
                REPO / "examples" / "contract_example.json",
                "--addr",
                frontend.address,
                "--policy",
                "off",
            )
        finally:
            frontend.stop()
    finally:
        worker.stop()
    return json.loads(out)


def test_wheel_holds_the_kernels_and_type_marker(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n.removeprefix("openjev/kernels/") for n in names if n.endswith(".cu")) == KERNELS
    assert all(n.startswith("openjev/kernels/") for n in names if n.endswith(".cu"))
    assert "openjev/py.typed" in names
    # one import namespace: nothing from the source folders' own names leaks into the wheel
    assert {n.split("/")[0] for n in names if not n.startswith("openjev_serve-")} == {"openjev"}


def test_wheel_holds_every_package_of_the_source_tree(wheel):
    # pyproject lists packages one by one: a new folder left out installs without it
    roots = {"common": "openjev", "frontend": "openjev/frontend", "worker": "openjev/worker", "tools": "openjev/tools"}
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, package in roots.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.relative_to(REPO / folder).as_posix()
            assert f"{package}/{relative}" in names, f"{folder}/{relative} is not in the wheel (pyproject packages)"


def test_base_install_has_no_worker_dependencies(base_env):
    for module in ("torch", "numpy", "safetensors"):
        done = subprocess.run([base_env, "-c", f"import {module}"], capture_output=True, check=False)
        assert done.returncode != 0, f"{module} is installed by the base install"
    # the frontend and the CLI import and parse their flags without them
    _run(base_env, "-m", launch.FRONTEND_MODULE, "--help")
    _run(base_env.parent / "openjev", "--help")


def test_installed_pair_answers_the_contract_example(base_env, demo_model, tmp_path):
    site_packages = Path(sysconfig.get_paths()["purelib"])
    worker_env = {"PYTHONPATH": str(site_packages)}
    installed = Path(
        _run(base_env, "-c", "import openjev.worker.main as m; print(m.__file__)", env={**os.environ, **worker_env})
    )
    assert installed.resolve().is_relative_to(base_env.parent.parent.resolve()), installed

    # the kernels' sources load from the installed copy: openjev.kernels is a namespace package
    # (cuda/ has no __init__.py), and kernel_folder() is where its one portion was installed
    code = (
        "import json; from openjev.worker.cuda import kernels; "
        f"print(json.dumps({{n: kernels.kernel_source(n[:-3]) for n in {KERNELS!r}}})); "
        "print(kernels.kernel_folder())"
    )
    sources, location = _run(base_env, "-c", code, env={**os.environ, **worker_env}).splitlines()
    assert Path(location).resolve().is_relative_to(base_env.parent.parent.resolve())
    assert json.loads(sources) == {n: (REPO / "cuda" / n).read_text(encoding="utf-8") for n in KERNELS}

    response = _answers_through_cli(base_env, demo_model, tmp_path, {**os.environ, **worker_env})
    assert_answers_close(response["answers"], reference_answers(demo_model, EXAMPLE), 1e-6)


@pytest.mark.slow
def test_worker_extra_installs_and_serves(wheel, demo_model, tmp_path):
    """`pip install 'openjev-serve[worker]'` alone is enough to run both servers."""
    python = _fresh_env(tmp_path / "venv", f"{wheel}[worker]")
    response = _answers_through_cli(python, demo_model, tmp_path / "run", None)
    assert_answers_close(response["answers"], reference_answers(demo_model, EXAMPLE), 1e-6)
