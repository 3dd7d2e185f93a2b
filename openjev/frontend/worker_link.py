"""The frontend's view of its worker(s): one gRPC channel, the worker's self-description, and
whether it is compatible (same ABI version, same tokenizer, same max_length)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import grpc

from openjev import abi, logs, serving
from openjev.worker.v1 import worker_pb2 as wire
from openjev.worker.v1 import worker_pb2_grpc

log = logs.get("openjev.frontend")


@dataclass(frozen=True)
class LinkState:
    """describe: the worker's last answer (None: none yet). problem: why requests are refused
    (None: compatible and reachable)."""

    describe: wire.DescribeResponse | None
    problem: str | None
    status: grpc.StatusCode


class WorkerLink:
    def __init__(self, target: str, *, fingerprint: str, max_length: int, refresh_seconds: float = 2.0,
                 on_state: Callable[[LinkState], None] = lambda state: None):
        self.target = target
        self._on_state = on_state
        self.channel = grpc.insecure_channel(target, options=serving.channel_options())
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self._fingerprint = fingerprint
        self._max_length = max_length
        self._refresh_seconds = refresh_seconds
        self._state = LinkState(None, f"worker at {target} has not answered yet", grpc.StatusCode.UNAVAILABLE)
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> LinkState:
        return self._state

    def start(self) -> None:
        """Describe now and then every refresh_seconds, so a restarted or replaced worker is
        checked again before traffic depends on it."""
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="worker-link", daemon=True)
        self._thread.start()

    def wait_compatible(self, timeout_seconds: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._state.problem is None, timeout_seconds)

    def close(self) -> None:
        self._stop.set()
        self.channel.close()

    def refresh(self) -> LinkState:
        try:
            describe = self.stub.Describe(wire.DescribeRequest(), timeout=self._refresh_seconds)
        except grpc.RpcError as error:
            state = LinkState(self._state.describe, f"worker at {self.target} is unavailable: {error.code().name}", grpc.StatusCode.UNAVAILABLE)
        else:
            state = LinkState(describe, self._incompatibility(describe), grpc.StatusCode.FAILED_PRECONDITION)
        if state.problem != self._state.problem:
            log.info("worker_link", target=self.target, problem=state.problem)
        with self._changed:
            self._state = state
            self._changed.notify_all()
        self._on_state(state)
        return state

    def _incompatibility(self, d: wire.DescribeResponse) -> str | None:
        if d.abi_version != abi.ABI_VERSION:
            return (f"worker ABI version {d.abi_version} does not match this frontend's ABI "
                    f"version {abi.ABI_VERSION}")
        if d.tokenizer_fingerprint != self._fingerprint:
            return (f"worker tokenizer fingerprint {d.tokenizer_fingerprint[:16]} does not match "
                    f"this frontend's {self._fingerprint[:16]}")
        if d.max_length != self._max_length:
            return f"worker max_length {d.max_length} does not match this frontend's {self._max_length}"
        return None

    def _loop(self) -> None:
        while not self._stop.wait(self._refresh_seconds):
            self.refresh()
