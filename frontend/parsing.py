"""Large request bodies parsed in child processes of the frontend.

JSON builds up to ~30 times its size in Python objects, and `json.loads` holds the GIL for all
of it where no hook runs (57 MiB of nested empty arrays: 6 s and 1.6 GB). Parsed in the
frontend's own process, such a body stalled every other request (a small one waited 2-3 s
behind a 23 MiB body) and its memory counted against the process that serves everyone. Here a
body over `service.LARGE_BODY_CHARS` goes to a child process (one per parse slot, started at the
first large body and kept), which parses it, renders its state and sends the compiled request
back; the frontend's thread waits without the GIL. A child that dies while parsing (killed for
memory, say) costs that request only (`ParseFailed`); the next large body gets a new child. A
request whose client leaves while its body is parsed has its child stopped at once.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from openjev import logs
from openjev.contract.request import DecisionRequest
from openjev.frontend.turns import RECHECK_SECONDS, Abandoned, Turns

log = logs.get("openjev.frontend.parsing")

# A fresh interpreter, not a fork: the frontend has gRPC's threads, which a fork would copy in an
# unknown state (and not multiprocessing's spawn, which imports the frontend's main module first).
CHILD_MODULE = "openjev.frontend.parse_child"
PARSE_FAILED = "request body could not be parsed: the process parsing it ended first (out of memory?); retry later"
SHUTTING_DOWN = "the frontend is shutting down"


class ParseFailed(Exception):
    """No compiled request: the child parsing the body ended before it answered, or the frontend
    is stopping (`stopping`: its children are stopped, not lost)."""

    def __init__(self, message: str, stopping: bool = False):
        super().__init__(message)
        self.stopping = stopping


class _Child:
    """One `parse_child` process and the frontend's end of its socket pair."""

    def __init__(self, parse: Callable[[str], DecisionRequest]):
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(parse)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """The process only: the pipe stays its user's (closing it under a thread that reads or
        writes it breaks that thread's call, or lets it read another file that takes the number)."""
        if self.alive():
            self.process.kill()

    def stop(self) -> None:
        self.conn.close()
        self.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:  # killed, so only a kernel in trouble keeps it
            pass


class BodyParsers:
    """`parse` (picklable: it runs in the children) on large bodies, in child processes: at most
    `slots` at once, the others waiting their turn in arrival order (`Turns`), so at most `slots`
    children; each parse takes an idle child or starts one."""

    def __init__(self, parse: Callable[[str], DecisionRequest], slots: int = 1):
        self._parse = parse
        self._turns: Turns[tuple[str, Callable[[], bool] | None], DecisionRequest] = Turns(
            self._in_child, slots, "parsed"
        )
        self._idle: list[_Child] = []
        self._busy: set[_Child] = set()
        self._lock = threading.Lock()
        self._closed = False

    def __call__(self, body: str, wanted: Callable[[], bool] | None = None) -> DecisionRequest:
        """The compiled request, or the ContractError the body gets in the frontend's own
        process. wanted: asked while the body waits its turn and while the child works; False
        leaves the queue, or stops the child (Abandoned)."""
        return self._turns((body, wanted), wanted)

    def _in_child(self, call: tuple[str, Callable[[], bool] | None]) -> DecisionRequest:
        body, wanted = call
        child = self._take()
        kept = False
        try:
            child.conn.send(body)
            while not child.conn.poll(RECHECK_SECONDS):
                if wanted is not None and not wanted():
                    raise Abandoned("the client went away (or its deadline passed) while its request was parsed")
            ok, value = child.conn.recv()
            kept = True
        except (EOFError, OSError) as error:
            if self._closed:
                raise ParseFailed(SHUTTING_DOWN, stopping=True) from None
            child.stop()
            log.warning("parse_child_ended", pid=child.pid, exitcode=child.process.returncode)
            raise ParseFailed(PARSE_FAILED) from error
        finally:
            self._give_back(child, kept)
        if ok:
            return value
        try:
            if isinstance(value, MemoryError):
                raise ParseFailed(PARSE_FAILED) from value
            raise value
        finally:
            # the error's traceback holds this frame: no cycle back to the error through it (the
            # cycle kept every refused body's frames, bodies and messages until a full collection)
            del value

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise ParseFailed(SHUTTING_DOWN, stopping=True)
            child = None
            while self._idle and child is None:
                child = self._idle.pop()
                if not child.alive():  # ended while idle: not this request's fault
                    child.stop()
                    child = None
        if child is None:
            child = _Child(self._parse)  # outside the lock: a spawn takes a moment
        with self._lock:
            if not self._closed:
                self._busy.add(child)
                return child
        child.stop()  # the frontend began to stop meanwhile
        raise ParseFailed(SHUTTING_DOWN, stopping=True)

    def _give_back(self, child: _Child, kept: bool) -> None:
        with self._lock:
            self._busy.discard(child)
            if kept and not self._closed:
                self._idle.append(child)
                return
        child.stop()

    def children(self) -> list[int]:
        """The children's process ids (idle and busy)."""
        with self._lock:
            return [c.pid for c in [*self._idle, *self._busy]]

    def close(self) -> None:
        """Stops every child, busy ones too (their callers get ParseFailed, `stopping`)."""
        with self._lock:
            self._closed = True
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
        for child in idle:
            child.stop()
        for child in busy:
            child.kill()  # its caller sees the pipe end, and stops it
