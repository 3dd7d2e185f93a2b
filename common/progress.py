"""Progress of long work: a bar redrawn in place on a terminal, plain lines in a log.

    for item in progress.track(items, "demo model: tensors"):
        ...

On a terminal (the stream is a tty) one line is redrawn at most 10 times a second; otherwise a
line is written at the start, about every 10 % or 10 s, and at the end, so a log of a long run
shows it advancing without a line per item. A server passes its logger: those lines are then
its log records (JSON like the rest of its log), not plain text among them.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

T = TypeVar("T")
_WIDTH = 30


class Progress:
    def __init__(
        self, label: str, total: int | None, *, stream: IO[str] | None = None, log: logging.Logger | None = None
    ):
        self.label = label
        self.log = log
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self._shown_at = self.started if not self.tty else 0.0
        self._shown_fraction = 0.0
        if not self.tty:
            self._line(f"{label}: started" + (f", {total} to do" if total else ""))

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.tty:
            if now - self._shown_at >= 0.1:
                self._shown_at = now
                self._draw(now)
            return
        fraction = self.done / self.total if self.total else 0.0
        if fraction - self._shown_fraction >= 0.1 or now - self._shown_at >= 10.0:
            self._shown_at, self._shown_fraction = now, fraction
            self._line(f"{self.label}: {self._count()} {now - self.started:.1f} s")

    def close(self) -> None:
        seconds = time.monotonic() - self.started
        if self.tty:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
        else:
            self._line(f"{self.label}: done, {self._count()} in {seconds:.1f} s")

    def _count(self) -> str:
        if not self.total:
            return str(self.done)
        return f"{self.done}/{self.total} ({100 * self.done / self.total:.0f} %)"

    def _draw(self, now: float) -> None:
        filled = round(_WIDTH * self.done / self.total) if self.total else 0
        bar = f"[{'#' * filled}{'.' * (_WIDTH - filled)}] " if self.total else ""
        self.stream.write(f"\r{self.label} {bar}{self._count()} {now - self.started:.1f} s\x1b[K")
        self.stream.flush()

    def _line(self, text: str) -> None:
        if self.log is not None:
            self.log.info(text)
            return
        self.stream.write(text + "\n")
        self.stream.flush()


def track(
    items: Iterable[T],
    label: str,
    total: int | None = None,
    *,
    stream: IO[str] | None = None,
    log: logging.Logger | None = None,
) -> Iterator[T]:
    """Yield `items`, showing how many have been handled (total: default len(items) if it has one;
    log: where the lines go when the stream is not a terminal)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    bar = Progress(label, total, stream=stream, log=log)
    try:
        for item in items:
            yield item
            bar.advance()
    finally:
        bar.close()
