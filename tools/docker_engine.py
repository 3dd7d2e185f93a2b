"""A Docker engine for `make compose-test` on a machine that may have none running (a clean CI
machine): use the one that answers, else start Debian's dockerd (root, or through passwordless
sudo) and stop it again afterwards. It starts on overlay2 where the kernel and the backing
filesystem allow it, else on vfs, which works anywhere but copies every layer's whole filesystem
(on this project's machines a `make compose-test` took 258 s on vfs, 113 s on overlay2).
Every way of not getting an engine ends in one `EngineError` line that says what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

# dockerd lives in /usr/sbin, which a user's PATH may lack.
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
# Tried in order: dockerd exits at start when a driver cannot work here (no overlay in the kernel,
# a backing filesystem without d_type, overlay on overlay).
STORAGE_DRIVERS = ("overlay2", "vfs")


class EngineError(RuntimeError):
    pass


class DriverRefused(EngineError):
    """dockerd exited at start: on another storage driver it may start."""


def _docker(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def privileged() -> list[str]:
    """The prefix that runs a command as root: none for root, `sudo -n` where that works."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    raise EngineError("this needs root (dockerd, debootstrap): run as root or with passwordless sudo")


# the engine's data root and storage driver, one `docker info` (a path may hold "|": rpartition)
INFO_FORMAT = "{{.DockerRootDir}}|{{.Driver}}"


class Engine:
    def __init__(self, workdir: Path):
        self.log_path = workdir / "dockerd.log"
        self.started: subprocess.Popen | None = None
        self.root = ""
        self.driver = ""

    def ensure(self, wait_seconds: float = 60) -> None:
        if shutil.which("docker") is None:
            raise EngineError("no docker command (Debian: apt-get install docker.io; `make compose-deps` does it)")
        info = _docker("info", "-f", INFO_FORMAT)
        if info.returncode != 0 and "permission denied" in info.stderr.lower():
            raise EngineError("a Docker engine runs but this user may not use it: add it to the docker group")
        if info.returncode != 0:
            for driver in STORAGE_DRIVERS:
                try:
                    info = self._start(driver, wait_seconds)
                    break
                except DriverRefused:
                    if driver == STORAGE_DRIVERS[-1]:
                        raise
        self.root, _, self.driver = info.stdout.strip().rpartition("|")

    def _start(self, driver: str, wait_seconds: float) -> subprocess.CompletedProcess:
        """dockerd on `driver`, and its first answer to `docker info -f INFO_FORMAT`."""
        if shutil.which("dockerd", path=SBIN_PATH) is None:
            raise EngineError("no Docker engine answers and dockerd is not installed (`make compose-deps`)")
        log = open(self.log_path, "ab")
        self.started = subprocess.Popen(
            [*privileged(), str(shutil.which("dockerd", path=SBIN_PATH)), "--storage-driver", driver],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + wait_seconds
        while (info := _docker("info", "-f", INFO_FORMAT)).returncode != 0:
            if "permission denied" in info.stderr.lower():
                self.stop()
                raise EngineError("dockerd started, but this user may not use its socket: add it to the docker group")
            if self.started.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
                raise DriverRefused(f"dockerd ({driver}) exited {self.started.returncode}: " + " | ".join(tail))
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"dockerd did not answer within {wait_seconds:.0f} s; see {self.log_path}")
            time.sleep(0.5)
        return info

    @property
    def ours(self) -> bool:
        """Whether this run started the engine (so what the engine holds is this run's alone)."""
        return self.started is not None

    def check_containers_run(self, image: str) -> None:
        """An engine can import and build yet be unable to start a container (no cgroups, no
        privileges for namespaces): say so here rather than as a failed build step."""
        result = _docker("run", "--rm", "--network", "none", "--entrypoint", "true", image, timeout=120)
        if result.returncode != 0:
            raise EngineError(f"the Docker engine cannot run containers: {result.stderr.strip()[-500:]}")

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.root or "/").free

    def stop(self) -> None:
        """Stop the dockerd started here (none that was running before)."""
        if self.started is None or self.started.poll() is not None:
            return
        if os.geteuid() == 0:
            self.started.terminate()
        else:  # started through sudo: its child runs as root
            subprocess.run([*privileged(), "kill", "-TERM", str(self.started.pid)], capture_output=True)
        try:
            self.started.wait(60)
        except subprocess.TimeoutExpired:
            self.started.kill()


class LowestFree:
    """`with LowestFree(path) as watch:` samples the free disk every second; `watch.lowest` is the
    least seen (a build's peak use, which the sizes of its results do not show)."""

    def __init__(self, path: str):
        self.path = path
        self.lowest = shutil.disk_usage(path).free
        self._done = threading.Event()

    def _sample(self) -> None:
        while not self._done.wait(1.0):
            self.lowest = min(self.lowest, shutil.disk_usage(self.path).free)

    def __enter__(self) -> LowestFree:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.lowest = min(self.lowest, shutil.disk_usage(self.path).free)
