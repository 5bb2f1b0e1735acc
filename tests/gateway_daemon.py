"""Helpers for the gateway tests: `hybridd start` with the HTTP gateway on a free
loopback port, and the gateway run alone (`python -m hybridd.gateway.process`)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.daemon import RunningDaemon, clean_env, daemon_process, free_port, stop

# Generous: the CI host has two busy cores and a worker imports torch.
STARTUP_TIMEOUT_S = 180.0
API_KEY = "sk-test-0123456789"


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None,
                 log: Path | None = None) -> list[str]:
    """Poll /health until 200; returns the states the 503s named on the way."""
    deadline = time.monotonic() + timeout
    last = None
    states: list[str] = []
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode}\n{log.read_text()[-6000:] if log else ''}")
        with contextlib.suppress(httpx.HTTPError):
            last = httpx.get(url + "/health", timeout=2)
            if last.status_code == 200:
                return states
            state = last.json()["error"]["state"]
            if not states or states[-1] != state:
                states.append(state)
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy within {timeout} s (last: {last and last.text})\n"
                         f"{log.read_text()[-6000:] if log else ''}")


@dataclass
class GatewayDaemon(RunningDaemon):
    port: int = 0
    key_file: Path | None = None
    startup_states: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def run_daemon_with_gateway(*flags: str, keys: tuple[str, ...] = (API_KEY,)) -> Iterator[GatewayDaemon]:
    """`hybridd start --http-endpoint 127.0.0.1:PORT` with an API key file of `keys`, until
    /health is 200."""
    base = Path(tempfile.mkdtemp(prefix="hg-"))
    key_file = base / "api_keys"
    key_file.write_text("# test keys\n" + "".join(f"{key}\n" for key in keys))
    port = free_port()
    log_level = {"HYBRIDD_LOG_LEVEL": os.environ.get("HYBRIDD_TEST_LOG_LEVEL", "warning")}
    with daemon_process("--no-compile-sampler", "--heartbeat-interval-s", "3", "--http-endpoint", f"127.0.0.1:{port}",
                        "--http-api-key-file", str(key_file), *flags, env=log_level) as started:
        daemon = GatewayDaemon(started.process, started.runtime_dir, started.log_path, port, key_file)
        daemon.startup_states = wait_healthy(daemon.url, STARTUP_TIMEOUT_S, daemon.process, daemon.log_path)
        yield daemon


@contextlib.contextmanager
def run_gateway(endpoint: str, *flags: str) -> Iterator[tuple[subprocess.Popen, Path]]:
    """The gateway alone against `endpoint`; stopped with SIGTERM at the end."""
    log_path = Path(tempfile.mkdtemp(prefix="gw-")) / "gateway.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "hybridd.gateway.process", "--endpoint", endpoint, *flags],
                                   env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process, log_path
    finally:
        stop(process, 20)


def wait_listening(port: int, process: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the gateway exited with {process.returncode}\n{log.read_text()[-4000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise AssertionError(f"the gateway did not listen on {port} within {timeout} s\n{log.read_text()[-4000:]}")
