"""A command-line tool stopped by SIGTERM or SIGHUP (a `timeout`, a container's stop, a closed
terminal) exits as Ctrl-C does: SystemExit, so its `finally` and `except` blocks run (servers it
started are stopped, temporary folders removed). The default action ended it on the spot."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _exit_on(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def exit_on_stop_signals() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, _exit_on)


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """A stop that comes inside the block acts at its end, as it would have acted. Not a signal
    mask: a process-wide signal reaches whichever thread does not block it (torch's threads), and
    Python runs its handler in the main thread all the same. Off the main thread: no deferral
    (handlers are the main thread's)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {int(signum): signal.signal(signum, lambda s, _f: came.append(s)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if came:
            handler = previous[came[0]]
            if callable(handler):
                handler(came[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(came[0])
