"""structlog for every log line: JSON in production, key-value on a terminal.

Request-scoped fields (request_id) travel through contextvars, so every line logged while a
request is handled carries them without being passed around.
"""

from __future__ import annotations

import logging
import sys

import structlog


def level_number(level: str) -> int:
    """The number of a logging level's name ("info" -> 20). (logging.getLevelNamesMapping is Python 3.11's;
    getLevelName maps a registered name to its number on every version.)"""
    number = logging.getLevelName(level.upper())
    if isinstance(number, int):
        return number
    raise ValueError(f"unknown log level {level!r}")


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    renderer: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_number(level)),
        # One write per line (message and newline together), so the lines of the server and its
        # workers, sharing one stderr, never run into each other.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
