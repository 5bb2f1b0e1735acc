"""The real daemon for the tests and the wire scripts: `hybridd start` in a subprocess
(the embedded tiny model, both real workers, real sockets), in a fresh runtime directory,
its output in a log file; drained with SIGTERM at the end (killed if it will not stop).

`daemon_process` starts it and does not wait; `run_daemon` waits until it answers
`health` with ok. The environment is the test's own without `HYBRIDD_*` settings (and
without systemd's NOTIFY_SOCKET), so only the flags configure the daemon.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import hybridd
from hybridd import Client
from tests.host_load import on_this_host



def _hybridd_command() -> str:
    """The `hybridd` console script beside this Python; where the package runs from a
    checkout without being installed (the GPU machine: PYTHONPATH names it), a script of
    the same two lines written once to the temporary directory."""
    installed = Path(sys.executable).parent / "hybridd"
    if installed.exists():
        return str(installed)
    launcher = Path(tempfile.gettempdir()) / f"hybridd-launcher-{os.getuid()}" / "hybridd"
    if not launcher.exists():
        launcher.parent.mkdir(parents=True, exist_ok=True)
        partial = launcher.with_suffix(f".{os.getpid()}")
        partial.write_text(f"#!{sys.executable}\nimport sys\nfrom hybridd.cli import main\nsys.exit(main())\n")
        partial.chmod(0o755)
        partial.replace(launcher)
    return str(launcher)


HYBRIDD = _hybridd_command()
STARTUP_TIMEOUT_S = 300.0  # a busy 2-core host can take minutes to start the daemon


def clean_env() -> dict[str, str]:
    """This process's environment without the settings that would configure the daemon."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDD_") and k != "NOTIFY_SOCKET"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(process: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (a drain), then SIGKILL after `timeout` seconds; reaped either way."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class RunningDaemon:
    process: subprocess.Popen
    runtime_dir: Path
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.runtime_dir}/hybridd.sock"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


@contextlib.contextmanager
def daemon_process(*flags: str, env: dict[str, str] | None = None, runtime_dir: Path | None = None,
                   **popen_options) -> Iterator[RunningDaemon]:
    """`hybridd start --runtime-dir DIR FLAGS...`, not waited for; stopped at the end.
    `env` is added to the clean environment; `popen_options` go to subprocess.Popen
    (e.g. `group`, `umask`)."""
    base = Path(tempfile.mkdtemp(prefix="hd-"))
    runtime_dir = runtime_dir or base / "run"
    log_path = base / "daemon.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([HYBRIDD, "start", "--runtime-dir", str(runtime_dir), *flags],
                                   env=clean_env() | (env or {}), stdout=log, stderr=subprocess.STDOUT,
                                   **popen_options)
    try:
        yield RunningDaemon(process, runtime_dir, log_path)
    finally:
        stop(process)


def wait_until_ok(endpoint: str, timeout: float, process: subprocess.Popen | None = None,
                  log_path: Path | None = None, **keys) -> float:
    """Poll `health` until ok; returns when (time.monotonic()). Fails at once if `process`
    exits, with the tail of `log_path`. `keys` go to the Client (CURVE keys)."""
    deadline = time.monotonic() + timeout
    tail = (lambda: "\n" + log_path.read_text(errors="replace")[-6000:]) if log_path else (lambda: "")
    with Client(endpoint, **keys) as client:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise AssertionError(f"the daemon exited with {process.returncode}{tail()}")
            with contextlib.suppress(hybridd.HybriddError):
                health = client.health(timeout=0.5)
                if health.ok:
                    assert health.state == "ready", f"health ok in state {health.state}"
                    return time.monotonic()
            time.sleep(0.1)
    raise AssertionError(f"{endpoint} not ready within {timeout} s{tail()}")


@contextlib.contextmanager
def run_daemon(*flags: str, env: dict[str, str] | None = None, **popen_options) -> Iterator[RunningDaemon]:
    """A ready daemon, sampler uncompiled (quick to start), logging warnings only."""
    with daemon_process("--no-compile-sampler", *flags, env={"HYBRIDD_LOG_LEVEL": "warning"} | (env or {}),
                        **popen_options) as daemon:
        wait_until_ok(daemon.endpoint, STARTUP_TIMEOUT_S, daemon.process, daemon.log_path)
        yield daemon


def wait_idle(client: Client, timeout: float = 30.0) -> dict:
    """The daemon's request counts once nothing runs or waits (or when `timeout`, scaled
    to the host's load, ends)."""
    deadline = time.monotonic() + on_this_host(timeout)
    while True:
        requests = client.status()["requests"]
        if requests["running"] == 0 and requests["queued"] == 0 or time.monotonic() > deadline:
            return requests
        time.sleep(0.02)
