"""Logging setup: every component logs through structlog, bound to its own context."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at the time of the call (test capture, redirection)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog once per process; later calls are no-ops.

    Logs go to stderr so that stdout stays free for command output.
    """
    global _configured
    if _configured:
        return
    level_name = (level or os.environ.get("HYBRIDD_LOG_LEVEL", "info")).upper()
    if json is None:
        json = os.environ.get("HYBRIDD_LOG_FORMAT", "console") == "json"
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(component: str, **bound) -> structlog.stdlib.BoundLogger:
    configure()
    return structlog.get_logger().bind(component=component, **bound)
