"""Liveness of the real daemon (`hybridd start`, the embedded model, both real workers):
a slow start-up on a saturated host is not a hang; a stopped serving loop is one, and is
caught within `heartbeat_timeout_s`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from hybridd import Client, EngineDeadError, exit_codes
from tests.daemon import HYBRIDD, daemon_process, wait_until_ok
from tests.test_client_sdk import LONG
from tests.host_load import on_this_host
from tests.processes import alive

SLOW_LOAD_S = 60.0


@contextlib.contextmanager
def busy_cores() -> Iterator[list[subprocess.Popen]]:
    """One spinning process per core, for as long as the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@pytest.mark.slow
def test_slow_load_on_a_saturated_host_is_ready_with_no_restart():
    """Default settings; every core spinning; the weight load stalled for 60 s."""
    with busy_cores(), daemon_process(env={"HYBRIDD_TEST_SLOW_LOAD_S": str(SLOW_LOAD_S)}) as daemon:
        process, rd, log_path = daemon.process, daemon.runtime_dir, daemon.log_path
        started = time.monotonic()
        ready_at = wait_until_ok(f"ipc://{rd}/hybridd.sock", SLOW_LOAD_S + 600, process, log_path)
        assert ready_at - started >= SLOW_LOAD_S
        with Client(f"ipc://{rd}/hybridd.sock", timeout=120) as client:
            status = client.status()
            assert status["state"] == "ready"
            assert {w: info["restarts"] for w, info in status["workers"].items()} == {"graph": 0, "context": 0}
            assert client.generate("ROMEO:", max_tokens=4, temperature=0).usage.completion_tokens == 4
        log = log_path.read_text()
        assert "loading slowly on purpose" in log
        assert "missed heartbeats" not in log and "worker failed" not in log and "restarting workers" not in log


@pytest.mark.parametrize("worker", ["context", "graph"])
def test_a_stopped_serving_loop_is_caught_and_in_flight_requests_end_with_engine_dead(worker):
    # Short enough to keep the test quick, long enough that on a busy host only the
    # stopped worker misses it.
    heartbeat_timeout_s = float(round(max(8.0, on_this_host(6.0))))
    with daemon_process("--no-compile-sampler", "--heartbeat-timeout-s", str(heartbeat_timeout_s),
                        "--log-format", "json") as daemon:
        process, rd, log_path = daemon.process, daemon.runtime_dir, daemon.log_path
        endpoint = f"ipc://{rd}/hybridd.sock"
        wait_until_ok(endpoint, 300, process, log_path)
        with Client(endpoint, timeout=120) as client:
            first = client.status()["workers"]
            stream = client.stream("ROMEO:", **LONG)
            next(iter(stream))
            stopped_at = time.monotonic()
            os.kill(first[worker]["pid"], signal.SIGSTOP)
            try:
                with pytest.raises(EngineDeadError):
                    for _ in stream:
                        pass
                # The last beat may have left just before the stop; then the supervisor's
                # 0.1 s tick, the kill, and the client's disconnect notice.
                bound = stopped_at + heartbeat_timeout_s + on_this_host(5.0)
                assert time.monotonic() < bound
                while alive(first[worker]["pid"]):
                    assert time.monotonic() < bound, f"the stopped {worker} generator was not killed in time"
                    time.sleep(0.05)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(first[worker]["pid"], signal.SIGCONT)
        wait_until_ok(endpoint, 300, process, log_path)
        with Client(endpoint, timeout=60) as client:
            second = client.status()["workers"]
        assert second["context"]["pid"] != first["context"]["pid"]
        assert second["graph"]["pid"] != first["graph"]["pid"]
        assert second["context"]["restarts"] == 1
    lines = log_path.read_text().splitlines()
    assert all(line.startswith("{") for line in lines), "\n".join(lines[-60:])  # every line is JSON
    records = [json.loads(line) for line in lines]
    failures = [r for r in records if r["event"] == "worker failed" and r["component"] == "supervisor"]
    assert [(r["worker"], r["reason"]) for r in failures] == [
        (worker, f"{worker} generator missed heartbeats for {heartbeat_timeout_s:g} s (hung)")]


def test_workers_outlive_a_killed_supervisor_by_under_two_seconds_and_the_next_start_cleans_up():
    with daemon_process("--no-compile-sampler") as daemon:
        process, rd, log_path = daemon.process, daemon.runtime_dir, daemon.log_path
        endpoint = f"ipc://{rd}/hybridd.sock"
        wait_until_ok(endpoint, 300, process, log_path)
        with Client(endpoint, timeout=60) as client:
            pids = [info["pid"] for info in client.status()["workers"].values()]
        process.kill()
        killed_at = time.monotonic()
        process.wait()
        for pid in pids:
            while alive(pid):
                assert time.monotonic() - killed_at < on_this_host(2.0), f"worker {pid} outlived the supervisor by 2 s (scaled to this host)"
                time.sleep(0.02)
        # What a SIGKILL leaves behind: the pid file and sockets, held by no one now.
        assert (rd / "hybridd.pid").exists()
        # The client commands say so in one line, within their connect timeout, and never hang.
        assert (rd / "hybridd.sock").exists()
        for command in (["generate", "ROMEO:", "--connect-timeout", "1"], ["status", "--timeout", "1"]):
            started = time.monotonic()
            stale = subprocess.run([HYBRIDD, *command, "--runtime-dir", str(rd)], capture_output=True, text=True,
                                   timeout=60)
            assert stale.returncode == exit_codes.NOT_RUNNING, stale.stderr
            assert stale.stderr == (f"hybridd is not running: no daemon at {endpoint} within 1 s: nothing listens on "
                                    f"{rd}/hybridd.sock (a stale socket left by a daemon that died?)\n")
            assert time.monotonic() - started < on_this_host(15.0)
        stop = subprocess.run([HYBRIDD, "stop", "--runtime-dir", str(rd)], capture_output=True, text=True, timeout=60)
        assert stop.returncode == exit_codes.NOT_RUNNING and stop.stderr.startswith("hybridd is not running")
    with daemon_process("--no-compile-sampler", runtime_dir=rd) as daemon:
        process, rd, log_path = daemon.process, daemon.runtime_dir, daemon.log_path
        wait_until_ok(endpoint, 300, process, log_path)
        with Client(endpoint, timeout=60) as client:
            assert client.generate("ROMEO:", max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_a_sigterm_from_anyone_but_the_supervisor_is_logged_with_its_sender_and_ignored():
    """The fuzzer's restarts had this in their log (both workers stopped, no error, the
    graph generator's exit 0, the context generator first): what a SIGTERM to the context
    generator did. Only the supervisor stops a worker; another sender is named in an
    error and the pair serves on, unrestarted."""
    with daemon_process("--no-compile-sampler", "--log-format", "json") as daemon:
        process, rd, log_path = daemon.process, daemon.runtime_dir, daemon.log_path
        endpoint = f"ipc://{rd}/hybridd.sock"
        wait_until_ok(endpoint, 300, process, log_path)
        with Client(endpoint, timeout=60) as client:
            first = client.status()["workers"]
            os.kill(first["context"]["pid"], signal.SIGTERM)
            deadline = time.monotonic() + on_this_host(30.0)
            while "SIGTERM ignored" not in log_path.read_text():
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.05)
            assert client.generate("ROMEO:", max_tokens=3).usage.completion_tokens == 3
            assert client.status()["workers"] == first
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    ignored = [r for r in records if r["event"].startswith("SIGTERM ignored")]
    assert [(r["level"], r["sender_pid"], r["pid"]) for r in ignored] == [("error", os.getpid(),
                                                                           first["context"]["pid"])]
    assert not [r for r in records if r["event"] == "worker failed"]
