"""structlog set-up shared by both servers: one JSON object per line on stderr."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import structlog


def quiet_grpc_core() -> None:
    """gRPC's C core writes its own lines to stderr, plain text among the servers' JSON lines: one
    at INFO for every failed TLS handshake, which any peer can cause without a limit. Its errors
    only, unless the operator sets GRPC_VERBOSITY. The variable is read at grpc's first import, so
    the servers' and the CLI's entry modules call this before theirs (not a package: a program
    that imports the client library keeps gRPC's default)."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


# The one attribute of a library's record that its JSON line carries beyond event, level, logger
# and timestamp (ThrottledLines sets it).
DROPPED = "dropped"


def configure(level: str = "info") -> None:
    # Lines of libraries that log through the standard library (uvicorn, asyncio, OpenTelemetry's
    # exporter, the CUDA runner's warnings) are JSON objects too: event, level, logger, timestamp.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(sort_keys=False),
            ],
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.stdlib.ExtraAdder(allow=[DROPPED]),
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get(name: str):
    return structlog.get_logger(name)


class Throttle:
    """At most one line a `seconds` for each kind of line: a client that can make a server log at
    will (junk sent to a port) must not be able to fill its log. `admit` says whether to log this
    one and how many of its kind were dropped since the last logged, so every one is counted."""

    def __init__(self, seconds: float = 1.0):
        self.seconds = seconds
        self._lock = threading.Lock()
        self._last: dict[object, float] = {}
        self._dropped: dict[object, int] = {}

    def admit(self, kind: object) -> int | None:
        """None: drop this line; else log it, with the number dropped before it (0 or more)."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.seconds:
                self._dropped[kind] = self._dropped.get(kind, 0) + 1
                return None
            self._last[kind] = now
            return self._dropped.pop(kind, 0)


class ThrottledLines(logging.Filter):
    """A library logger's warnings (what clients can cause), each message at most once a second
    (`Throttle`); the next one logged carries `dropped`. Errors all pass: each may be another bug,
    with its own traceback. Messages in `replaced` are dropped: a line of ours says more."""

    def __init__(self, replaced: frozenset[str] = frozenset(), seconds: float = 1.0):
        super().__init__()
        self.replaced = replaced
        self.throttle = Throttle(seconds)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in self.replaced:
            return False
        if record.levelno > logging.WARNING:
            return True
        dropped = self.throttle.admit(record.msg)
        if dropped is None:
            return False
        if dropped:
            setattr(record, DROPPED, dropped)
        return True
