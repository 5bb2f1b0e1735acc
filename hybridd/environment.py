"""The process environment: every variable hybridd reads, declared once, and the one
module that touches `os.environ`.

The settings (`hybridd/config.py`) come from a TOML file, `HYBRIDD_<NAME>` variables and
flags; this module hands their variables over (`snapshot`) without knowing their names.
What it declares here are the other variables: the configuration file's path, the log
settings that logging reads before any configuration exists, the step tracer's, the ones
systemd and a user's session set, Triton's interpreter switch and the tests' hooks. A
read of a variable that is not declared here is a programming error (`LookupError`), so
the table below cannot fall behind the code. Variables named `HYBRIDD_TEST_*` belong to
the test suite and are never taken for settings.

It sits in the lowest layer: logging, the kernels, the sampler and the step tracer read
through it without reaching up to the configuration.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

TEST_PREFIX = "HYBRIDD_TEST_"  # the test suite's own variables (and hooks, declared below)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvironmentVariableError(ValueError):
    """A declared variable holds a value of the wrong kind; the message names it."""


@dataclass(frozen=True)
class Variable:
    name: str
    type: type  # str, int, float or bool: how `flag` and `number` read it
    default: str | int | float | bool | None  # None: unset means "not there"
    meaning: str
    group: str
    setting: str = ""  # the Config field this variable also sets (read early, before any configuration)


def _declare(*variables: Variable) -> dict[str, Variable]:
    return {v.name: v for v in variables}


VARIABLES: dict[str, Variable] = _declare(
    Variable("HYBRIDD_CONFIG", str, None, "The TOML configuration file that `hybridd` commands read when no "
             "`--config` is given.", "hybridd"),
    Variable("HYBRIDD_LOG_LEVEL", str, None, "The `log_level` setting. Every process's logging reads it at its "
             "first line, before it has a configuration.", "hybridd", setting="log_level"),
    Variable("HYBRIDD_LOG_FORMAT", str, None, "The `log_format` setting, read like `HYBRIDD_LOG_LEVEL`.", "hybridd",
             setting="log_format"),
    Variable("HYBRIDD_TRACE_DIR", str, None, "Turns the step tracer on (hybridd/runtime/step_trace.py): each worker "
             "writes its trace and marks of a window of steps into this directory.", "step tracer"),
    Variable("HYBRIDD_TRACE_WARMUP", int, 100, "Steps each worker runs before the traced window opens.",
             "step tracer"),
    Variable("HYBRIDD_TRACE_STEPS", int, 200, "Steps in the traced window.", "step tracer"),
    Variable("HYBRIDD_TRACE_KERNELS", bool, True, "Record the window's CUDA kernels with the PyTorch profiler "
             "(trace-ROLE-PID.json).", "step tracer"),
    Variable("HYBRIDD_TRACE_CPU", bool, False, "With the kernels, record the host side too (CUDA runtime calls, "
             "operators).", "step tracer"),
    Variable("HYBRIDD_TRACE_MARKS", bool, False, "Record the hot path's milestones with their CLOCK_MONOTONIC time "
             "(marks-ROLE-PID.json); a mark costs a list append.", "step tracer"),
    Variable("NOTIFY_SOCKET", str, None, "Set by systemd for a `Type=notify` service: where the supervisor sends "
             "READY=1, STATUS= and WATCHDOG=1. Unset: no notifications.", "systemd"),
    Variable("WATCHDOG_USEC", int, None, "Set by systemd's `WatchdogSec=` (microseconds): the supervisor sends "
             "WATCHDOG=1 every half of it.", "systemd"),
    Variable("WATCHDOG_PID", int, None, "Set by systemd with `WATCHDOG_USEC`: the process the watchdog is meant for; "
             "another process ignores it.", "systemd"),
    Variable("RUNTIME_DIRECTORY", str, None, "Set by systemd's `RuntimeDirectory=`: its first path is the default "
             "`runtime_dir`.", "systemd"),
    Variable("XDG_RUNTIME_DIR", str, None, "A user session's runtime directory: without `RUNTIME_DIRECTORY`, the "
             "default `runtime_dir` is its `hybridd` subdirectory (else /tmp/hybridd-UID).", "session"),
    Variable("HF_HUB_CACHE", str, None, "The Hugging Face hub cache where a `model` given as a hub id (ORG/NAME) "
             "is looked for (hybridd never downloads).", "hugging face"),
    Variable("HF_HOME", str, None, "Without `HF_HUB_CACHE`, the hub cache is its `hub` subdirectory.",
             "hugging face"),
    Variable("XDG_CACHE_HOME", str, None, "Without `HF_HUB_CACHE` and `HF_HOME`, the hub cache is its "
             "`huggingface/hub` (else ~/.cache/huggingface/hub).", "hugging face"),
    Variable("TRITON_INTERPRET", bool, False, "Triton's own switch: run the Triton kernels in its CPU interpreter. "
             "hybridd reads it to keep the kernels' launch choices the interpreter can run; the test suite sets "
             "it.", "triton"),
    Variable("TRITON_CACHE_DIR", str, None, "Triton's own: where it keeps compiled kernels (else ~/.triton/cache). "
             "The bench counts the files there to tell a first start from a later one.", "triton"),
    Variable("TORCHINDUCTOR_CACHE_DIR", str, None, "PyTorch Inductor's own: where it keeps compiled code (else "
             "torchinductor_USER in the temporary directory). The bench counts its files like Triton's.", "triton"),
    Variable(TEST_PREFIX + "FREE_MEMORY_BYTES", int, None, "A test hook: the graph generator takes this for the "
             "device's free memory when it fits max_batch beside the weights and the KV cache.", "tests"),
    Variable(TEST_PREFIX + "SLOW_LOAD_S", float, 0.0, "A test hook: the graph generator sleeps this many seconds "
             "before it loads the model, as a cold disk would make it wait.", "tests"),
)


def _declared(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise LookupError(f"{name} is not a declared environment variable (hybridd/environment.py)") from None


def get(name: str) -> str | None:
    """The declared variable's value as set, or None when it is unset or empty."""
    _declared(name)
    return os.environ.get(name) or None


def flag(name: str) -> bool:
    """A declared yes/no variable: 1/true/yes/on or 0/false/no/off; unset or empty is its default."""
    variable = _declared(name)
    if variable.type is not bool:
        raise LookupError(f"{name} is declared as {variable.type.__name__}, not as a flag")
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return bool(variable.default)
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise EnvironmentVariableError(f"{name} must be one of {', '.join(_TRUE + _FALSE)}, got {os.environ[name]!r}")


def number(name: str) -> int | float:
    """A declared numeric variable; unset or empty is its default."""
    variable = _declared(name)
    if variable.type not in (int, float):
        raise LookupError(f"{name} is declared as {variable.type.__name__}, not as a number")
    value = os.environ.get(name, "").strip()
    if not value:
        return variable.type(variable.default)
    try:
        return variable.type(value)
    except ValueError:
        kind = "a whole number" if variable.type is int else "a number"
        raise EnvironmentVariableError(f"{name} must be {kind}, got {value!r}") from None


def is_setting_variable(name: str) -> bool:
    """Whether `name` is a setting's `HYBRIDD_<NAME>` (known or misspelt) rather than a declared variable."""
    if not name.startswith("HYBRIDD_") or name.startswith(TEST_PREFIX):
        return False
    variable = VARIABLES.get(name)
    return variable is None or bool(variable.setting)


def snapshot() -> dict[str, str]:
    """A copy of the whole environment: the settings' layer and the start of a child's environment."""
    return dict(os.environ)


def for_child(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a child process: this one's with `extra` set."""
    return {**os.environ, **extra}


def export(values: Mapping[str, str]) -> dict[str, str | None]:
    """Set `values` in this process's environment (children spawned later inherit them);
    returns what they replaced, for `restore`."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    return previous


def export_defaults(values: Mapping[str, str]) -> dict[str, str | None]:
    """`export` of the `values` whose variables are unset; returns what it replaced, for `restore`."""
    return export({key: value for key, value in values.items() if key not in os.environ})


def restore(previous: Mapping[str, str | None]) -> None:
    """Undo `export`: each variable back to its earlier value, or unset."""
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
