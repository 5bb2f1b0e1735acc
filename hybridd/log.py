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


_threshold = logging.INFO


def _filter_by_level(logger, method_name: str, event_dict):
    # A processor rather than a filtering wrapper class: module-level loggers are bound at
    # import time, before a worker applies its configured level, and must still obey it.
    if logging.getLevelName(method_name.upper()) < _threshold:
        raise structlog.DropEvent
    return event_dict


def configure(level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog once per process; a later call with a level changes the level.

    Logs go to stderr so that stdout stays free for command output.
    """
    global _configured, _threshold
    if level is not None:
        _threshold = getattr(logging, level.upper(), logging.INFO)
    if _configured:
        return
    level_name = (level or os.environ.get("HYBRIDD_LOG_LEVEL", "info")).upper()
    _threshold = getattr(logging, level_name, logging.INFO)
    if json is None:
        json = os.environ.get("HYBRIDD_LOG_FORMAT", "console") == "json"
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            _filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(component: str, **bound) -> structlog.stdlib.BoundLogger:
    configure()
    return structlog.get_logger().bind(component=component, **bound)
