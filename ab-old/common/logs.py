"""structlog set-up shared by both servers: one JSON object per line on stderr."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info") -> None:
    logging.basicConfig(stream=sys.stderr, format="%(message)s", level=level.upper())
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
