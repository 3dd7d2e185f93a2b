"""`make compose-test`'s own engine starts on overlay2 where dockerd accepts it and on vfs where
dockerd exits at start on overlay2 (a kernel without overlay, a backing filesystem without
d_type). The machine's dockerd is not started here: fake `docker` and `dockerd` scripts on the
PATH inject the refusal (the real run on overlay2 is docs/deploy.md's measurement)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from openjev.tools import docker_engine

# `docker info` answers once the fake dockerd runs (its driver in the file `running`), as the real one does.
DOCKER = """#!/bin/sh
[ -f "$FAKE_DIR/running" ] || { echo "Cannot connect to the Docker daemon" >&2; exit 1; }
case "$*" in
  *"{{.DockerRootDir}}|{{.Driver}}"*) echo "/var/lib/docker|$(cat "$FAKE_DIR/running")" ;;
  *) echo "fake docker: unexpected arguments $*" >&2; exit 2 ;;
esac
"""
DOCKERD = """#!/bin/sh
echo "$*" >> "$FAKE_DIR/started"
case " $FAKE_REFUSE " in  # $2: the driver (dockerd --storage-driver DRIVER)
  *" $2 "*) echo "error initializing graphdriver: driver not supported" >&2; exit 1 ;;
esac
echo "$2" > "$FAKE_DIR/running"
trap 'rm -f "$FAKE_DIR/running"; exit 0' TERM
while :; do sleep 0.1; done
"""


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("docker", DOCKER), ("dockerd", DOCKERD)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    monkeypatch.setattr(docker_engine, "SBIN_PATH", str(bin_dir))
    monkeypatch.setattr(docker_engine, "privileged", lambda: [])  # no sudo in the way of the fake
    return tmp_path


def started_with(fake: Path) -> list[str]:
    return fake.joinpath("started").read_text().splitlines()


@pytest.mark.parametrize(
    ("refused", "tried", "driver"),
    [
        ("none", ["overlay2"], "overlay2"),
        ("overlay2", ["overlay2", "vfs"], "vfs"),
    ],
)
def test_the_engine_starts_on_the_first_driver_dockerd_accepts(fake_engine, monkeypatch, refused, tried, driver):
    monkeypatch.setenv("FAKE_REFUSE", refused)
    engine = docker_engine.Engine(fake_engine)
    try:
        engine.ensure(wait_seconds=20)
        assert [line.split()[-1] for line in started_with(fake_engine)] == tried
        assert (engine.driver, engine.root, engine.ours) == (driver, "/var/lib/docker", True)
    finally:
        engine.stop()
    assert not fake_engine.joinpath("running").exists()  # stopped again


def test_dockerd_refused_on_every_driver_is_one_error_naming_the_last(fake_engine, monkeypatch):
    monkeypatch.setenv("FAKE_REFUSE", "overlay2 vfs")
    with pytest.raises(docker_engine.EngineError, match=r"dockerd \(vfs\) exited 1: .*driver not supported"):
        docker_engine.Engine(fake_engine).ensure(wait_seconds=20)
    assert [line.split()[-1] for line in started_with(fake_engine)] == ["overlay2", "vfs"]


def test_an_engine_that_answers_is_used_as_it_is(fake_engine):
    fake_engine.joinpath("running").write_text("devicemapper\n")
    engine = docker_engine.Engine(fake_engine)
    engine.ensure(wait_seconds=20)
    assert (engine.driver, engine.ours) == ("devicemapper", False)
    assert not fake_engine.joinpath("started").exists()
