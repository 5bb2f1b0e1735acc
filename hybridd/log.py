"""Logging setup: every component logs through structlog, bound to its own context.

One line per event on stderr, rendered for a console or as JSON (`log_format`). The
level and the format can change after loggers were bound (module-level loggers, a
worker applying its configuration, SIGHUP reloading the level): both are read at each
event. Records of the standard `logging` module (libraries such as transformers),
`warnings` and the exceptions Python cannot raise (`sys.unraisablehook`) go through the
same chain, so that in JSON mode every line is JSON.
"""

from __future__ import annotations

import logging
import sys

import structlog

from hybridd import environment

_configured = False
_threshold = logging.INFO
_json = False

_console = structlog.dev.ConsoleRenderer(colors=False)
_json_renderer = structlog.processors.JSONRenderer()
_format_exception = structlog.processors.format_exc_info


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at the time of the call (test capture, redirection)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _filter_by_level(logger, method_name: str, event_dict):
    # A processor rather than a filtering wrapper class: module-level loggers are bound at
    # import time, before a worker applies its configured level, and must still obey it.
    if logging.getLevelName(method_name.upper()) < _threshold:
        raise structlog.DropEvent
    return event_dict


def _render(logger, method_name: str, event_dict):
    if _json:
        return _json_renderer(logger, method_name, _format_exception(logger, method_name, event_dict))
    return _console(logger, method_name, event_dict)


class _ToStructlog(logging.Handler):
    """Hands standard-library log records to structlog (one renderer for every line)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            method = record.levelname.lower() if record.levelname.lower() in (
                "debug", "info", "warning", "error", "critical") else "info"
            fields = {"logger": record.name}
            if record.exc_info:
                fields["exc_info"] = record.exc_info
            getattr(structlog.get_logger().bind(component=record.name), method)(record.getMessage(), **fields)
        except Exception:  # noqa: BLE001 (logging must never raise into the caller)
            self.handleError(record)


def level() -> str:
    return logging.getLevelName(_threshold).lower()


def configure(level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog once per process; later calls change the level and the format.

    Logs go to stderr so that stdout stays free for command output. Without arguments
    the first call reads `HYBRIDD_LOG_LEVEL` and `HYBRIDD_LOG_FORMAT`.
    """
    global _configured, _threshold, _json
    if not _configured:
        level = level or environment.get("HYBRIDD_LOG_LEVEL") or "info"
        if json is None:
            json = environment.get("HYBRIDD_LOG_FORMAT") == "json"
    if level is not None:
        _threshold = getattr(logging, level.upper(), logging.INFO)
    if json is not None:
        _json = json
    root = logging.getLogger()
    root.setLevel(_threshold)
    if _configured:
        return
    structlog.configure(
        processors=[
            _filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            _render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        # One write per line: stderr is unbuffered when redirected, and the supervisor and
        # its workers share it, so a record and its newline written apart can be split by
        # another process's record.
        logger_factory=structlog.WriteLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    root.handlers[:] = [_ToStructlog()]
    logging.captureWarnings(True)
    sys.unraisablehook = _log_unraisable
    _configured = True


def _log_unraisable(unraisable) -> None:
    """An exception Python cannot raise (in a finalizer, a `__del__`, an atexit callback),
    which it would print as lines of its own: one error event instead."""
    try:
        structlog.get_logger().bind(component="python").error(
            "exception_ignored", where=f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}",
            exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))
    except Exception:  # noqa: BLE001 (the interpreter may be shutting down: its own printer then)
        sys.__unraisablehook__(unraisable)


def get_logger(component: str, **bound) -> structlog.stdlib.BoundLogger:
    configure()
    return structlog.get_logger().bind(component=component, **bound)
