"""A command-line tool stopped by SIGTERM or SIGHUP (a `timeout`, a container's stop, a closed
terminal) exits as Ctrl-C does: SystemExit, so its `finally` and `except` blocks run (servers it
started are stopped, temporary folders removed). The default action ended it on the spot."""

from __future__ import annotations

import signal

STOP_SIGNALS = {signal.SIGTERM, signal.SIGHUP}


def _exit_on(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def exit_on_stop_signals() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, _exit_on)
