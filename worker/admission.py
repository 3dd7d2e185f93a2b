"""Bounded FIFO admission: one request executes at a time (one GPU, one stream); up to
`capacity` more wait in arrival order. A full queue refuses at once rather than letting
latency grow without bound; a request whose client went away leaves the queue."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class QueueFull(Exception):
    pass


class Abandoned(Exception):
    """The client cancelled or its deadline passed while the request waited."""


@dataclass
class _Job(Generic[T]):
    work: Callable[[], T]
    is_active: Callable[[], bool]
    done: threading.Event = field(default_factory=threading.Event)
    result: T | None = None
    error: BaseException | None = None
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None


class AdmissionQueue:
    def __init__(self, capacity: int, *, poll_seconds: float = 0.02):
        if capacity < 0:
            raise ValueError("queue capacity must be >= 0")
        self.capacity = capacity
        self._poll_seconds = poll_seconds
        self._waiting: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._executing = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting plus the one executing."""
        with self._cond:
            return len(self._waiting) + int(self._executing)

    def run(self, work: Callable[[], T], *, is_active: Callable[[], bool]) -> tuple[T, float]:
        """Run `work` in its turn; returns (its result, seconds spent waiting in the queue).
        Raises QueueFull at once when `capacity` requests already wait behind a busy executor,
        Abandoned when the client goes away before its turn, or whatever `work` raised."""
        job: _Job[T] = _Job(work, is_active)
        with self._cond:
            if self._closed:
                raise QueueFull("worker is shutting down")
            busy = self._executing or bool(self._waiting)
            if busy and len(self._waiting) >= self.capacity:
                raise QueueFull(f"worker queue is full ({self.capacity} waiting)")
            self._waiting.append(job)
            self._cond.notify_all()
        while not job.done.wait(self._poll_seconds):
            if not is_active():
                with self._cond:
                    if job in self._waiting:
                        self._waiting.remove(job)
                        raise Abandoned("client went away while queued")
                # Already executing: the engine checks is_active at its next launch boundary.
        if job.error is not None:
            raise job.error
        assert job.started_at is not None
        # the work returned (no error), so result holds its value, None included
        return cast(T, job.result), job.started_at - job.queued_at

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self._executing = True
            job.started_at = time.perf_counter()
            try:
                job.result = job.work()
            except BaseException as error:  # handed to the waiting RPC thread, which maps it
                job.error = error
            finally:
                with self._cond:
                    self._executing = False
                job.done.set()
