"""The hostile mix's settings, and the soak's own worker that its `kill` part kills.

The mix's parts run beside the clients (see docs/reliability.md); their threads are in parts.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openjev.tools.launch import Process

HOSTILE_PARTS = ("idle", "oversized", "cancel", "kill")
# Statuses a request may end with while the worker is down (from the kill until the frontend is
# SERVING again, plus KILL_SLACK_SECONDS), besides the one its kind expects.
DURING_KILL = {"UNAVAILABLE", "DEADLINE_EXCEEDED"}
KILL_SLACK_SECONDS = 2.0


@dataclass
class Hostile:
    """What the hostile mix adds beside the clients (see docs/reliability.md)."""

    parts: tuple[str, ...] = HOSTILE_PARTS
    watch_streams: int = 36  # idle health Watch streams on the public port (the cap is 32)
    reflection_streams: int = 10  # idle reflection streams on the public port (the cap is 8)
    execute_streams: int = 4  # Execute streams on the worker port that never commit
    commit_timeout_seconds: float = 3.0  # the worker's --commit-timeout-seconds (own pair)
    kills: int = 2  # kill -9 of the worker, spread over the run (own pair)
    max_rendered_bytes: int = 64 * 2**20  # the frontend's --max-rendered-bytes
    max_request_tokens: int = 32768  # the frontend's --max-request-tokens (the soak's own pair sets it)
    request_bound_seconds: float = 30.0  # a request without a status after this long is hung
    stream_bound_seconds: float = 10.0  # an idle stream must answer (or be refused) within this
    memory_bound_mib: float = 128.0  # after - before, per process

    def has(self, part: str) -> bool:
        return part in self.parts


class WorkerControl:
    """The soak's own worker: kill -9 and start again on the same port (same flags)."""

    def __init__(self, model: Path, workdir: Path, args: list[str], process: Process):
        self.model, self.workdir, self.args, self.process = model, workdir, args, process
        self.restarts = 0

    @property
    def address(self) -> str:
        return self.process.address

    def kill_and_restart(self) -> None:
        from openjev.tools import launch

        self.process.kill()
        self.restarts += 1
        self.process = launch.start_worker(self.model, self.workdir, self.args, name=f"worker-{self.restarts}")

    def stop(self) -> None:
        self.process.stop()
