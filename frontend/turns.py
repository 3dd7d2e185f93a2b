"""A gate that runs a function on the caller's thread, a few calls at once, the rest in arrival order.

The frontend's CPU-heavy steps go through one each: tokenizing (two lanes, `batches.EncodeLanes`)
and parsing large request bodies (`parsing.BodyParsers`), so that a few large requests
cannot take every core, or many gigabytes at once, while small ones wait.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

A = TypeVar("A")
R = TypeVar("R")
# How often a waiter asks whether its call is still wanted: a call that ended while it waited
# (client gone, deadline passed) leaves the queue within this, not at its turn, which could be
# minutes away behind large bodies, while it held a server thread.
RECHECK_SECONDS = 0.25


class Abandoned(Exception):
    """Not run: its client had gone by its turn."""


class Turns(Generic[A, R]):
    """Runs `run` on the caller's thread, at most `slots` calls at once, the others waiting their
    turn in arrival order. Where a free slot exists nothing waits: a small request's step runs
    with no thread hand-off (a pool's submit-and-wait costs two wake-ups). `doing`: what the
    waiters wait for, in Abandoned's message."""

    def __init__(self, run: Callable[[A], R], slots: int, doing: str):
        if slots < 1:
            raise ValueError("slots must be positive")
        self._run = run
        self._doing = doing
        self._free = slots
        self._turns: deque[threading.Lock] = deque()  # held locks of waiters, first come first
        self._lock = threading.Lock()

    def __call__(self, arg: A, wanted: Callable[[], bool] | None = None) -> R:
        """wanted: asked while the call waits and once its turn has come; False (the client left
        or its deadline passed) leaves the queue, or passes the slot on unused, and raises
        Abandoned (a cancelled request's batches once took their turns and held a 3.7 s request
        19 s behind them)."""
        with self._lock:
            turn = None
            if self._free and not self._turns:
                self._free -= 1
            else:
                turn = threading.Lock()
                turn.acquire()
                self._turns.append(turn)
        if turn is not None:
            self._wait(turn, wanted)
        try:
            if wanted is not None and not wanted():
                raise self._abandoned()
            return self._run(arg)
        finally:
            with self._lock:
                if self._turns:
                    self._turns.popleft().release()  # the slot passes on, never freed in between
                else:
                    self._free += 1

    def _wait(self, turn: threading.Lock, wanted: Callable[[], bool] | None) -> None:
        """Until `turn` is released by the call that hands its slot over; a call no longer wanted
        leaves the queue at once (Abandoned) unless the slot has just been handed to it."""
        while not turn.acquire(timeout=RECHECK_SECONDS):
            if wanted is None or wanted():
                continue
            with self._lock:
                if turn in self._turns:
                    self._turns.remove(turn)
                    raise self._abandoned()
            turn.acquire()  # handed over meanwhile: the slot is ours, to pass on unused
            return

    def _abandoned(self) -> Abandoned:
        return Abandoned(f"the client went away (or its deadline passed) while its request waited to be {self._doing}")
