"""A real daemon for the tools: `hybridd start` in a subprocess with its settings as
flags, in a fresh runtime directory, its log in a file; ready once `health` answers ok;
drained with SIGTERM at the end (killed if it will not stop).

Its lifecycle phases come from its own log (`--log-format json`), each with the time
the supervisor logged it, so a start can be split into its phases without a hook into
the daemon. Beside it, what the wire tools share of the raw protocol (SPEC.md): a
message packed (`pack`), a session of its own (`dealer`), the daemon's `status_of`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import msgpack
import zmq

import hybridd
from hybridd import Client, environment

_CONSOLE_SCRIPT = Path(sys.executable).parent / "hybridd"


def start_command() -> list[str]:
    """`hybridd start`: the installed console script, or the CLI through this interpreter."""
    if _CONSOLE_SCRIPT.exists():
        return [str(_CONSOLE_SCRIPT), "start"]
    return [sys.executable, "-c", "import sys; from hybridd.cli import main; sys.exit(main())", "start"]


def flags(settings: dict) -> list[str]:
    """Config settings as `hybridd start` flags (`--name VALUE`, `--name/--no-name`)."""
    out = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


class Daemon:
    """`hybridd start` with `settings`, in this process's environment; a context manager
    that closes it."""

    def __init__(self, settings: dict, ready_timeout: float = 300.0):
        self.base = Path(tempfile.mkdtemp(prefix="hd-"))
        self.runtime_dir = self.base / "run"
        self.log_path = self.base / "daemon.log"
        child_environment = {k: v for k, v in environment.snapshot().items() if k != "NOTIFY_SOCKET"}
        settings = {"log_level": "info", **settings, "log_format": "json", "runtime_dir": self.runtime_dir}
        self.spawned_wall, self.spawned = time.time(), time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen([*start_command(), *flags(settings)], env=child_environment, stdout=log,
                                            stderr=subprocess.STDOUT)
        try:
            self.ready = self._wait_ready(ready_timeout)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.runtime_dir}/hybridd.sock"

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _wait_ready(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        with Client(self.endpoint) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the daemon exited with {self.process.returncode}:\n{self.log_tail()}")
                with contextlib.suppress(hybridd.HybriddError):
                    if client.health(timeout=0.5).ok:
                        return time.perf_counter()
                time.sleep(0.05)
        raise TimeoutError(f"{self.endpoint} not ready within {timeout} s:\n{self.log_tail()}")

    def phases(self) -> list[tuple[float, str, str, str]]:
        """(seconds after the spawn, worker, phase, detail) of each phase the supervisor logged."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "worker phase" and "timestamp" in event:
                at = datetime.fromisoformat(event["timestamp"]).timestamp() - self.spawned_wall
                out.append((at, str(event.get("worker")), str(event.get("phase")), str(event.get("detail", ""))))
        return out

    def close(self, timeout: float = 60.0) -> None:
        stop(self.process, timeout)
        shutil.rmtree(self.base, ignore_errors=True)


def stop(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM (a daemon drains), SIGKILL where it has not exited within `timeout` s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def running(settings: dict | None = None, ready_timeout: float = 300.0) -> Daemon:
    """A ready daemon for a `with` block (the embedded model unless `settings` name one)."""
    return Daemon({"compile_sampler": False, "log_level": "warning", **(settings or {})}, ready_timeout)


def argument_parser(description: str | None):
    """A wire tool's parser, with the daemon's arguments (`--endpoint`, `--start`)."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", help="a running daemon (default: --start one)")
    parser.add_argument("--start", action="store_true", help="start a daemon on the embedded model for the run")
    return parser


@contextlib.contextmanager
def daemon_endpoint(args) -> Iterator[str]:
    """The endpoint to run against, with a daemon started for the run when asked."""
    if args.endpoint and not args.start:
        yield args.endpoint
        return
    with running() as daemon:
        yield daemon.endpoint


# ----------------------------------------------------------------------------- the raw wire, for the wire tools


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def dealer(context: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER connected to `endpoint`: one session of its own."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    return socket


def status_of(context: zmq.Context, endpoint: str, timeout_s: float = 30.0) -> dict:
    """The daemon's `status`, asked on a session of its own."""
    socket = dealer(context, endpoint)
    try:
        socket.send(pack({"v": 1, "type": "status", "id": "tool-status"}))
        if not socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no status reply within {timeout_s} s")
        return msgpack.unpackb(socket.recv())["status"]
    finally:
        socket.close()
