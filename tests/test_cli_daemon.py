"""The `hybridd` command against the real daemon: keygen, status, generate, TCP with
CURVE, stop (drain), and the answers when no daemon runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hybridd import Client, DrainingError, HandshakeRefusedError, HybriddError, RequestCancelledError
from hybridd.cli import EXIT_NOT_RUNNING, EXIT_REFUSED
from hybridd.client import load_curve_keys
from tests.daemon import HYBRIDD, STARTUP_TIMEOUT_S, daemon_process, free_port, run_daemon, wait_until_ok


def _hybridd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([HYBRIDD, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("keys")
    for name, where in (("server", directory), ("alice", directory / "clients"), ("mallory", directory)):
        done = _hybridd("keygen", "--dir", str(where), "--name", name)
        assert done.returncode == 0, done.stderr
    # Only alice's public key is authorised.
    (directory / "clients" / "alice.key_secret").rename(directory / "alice.key_secret")
    return directory


def test_keygen_writes_a_curve_pair_and_never_overwrites(keys):
    public, secret = load_curve_keys(str(keys / "server.key_secret"))
    assert len(public) == 40 and len(secret) == 40
    assert load_curve_keys(str(keys / "server.key"))[0] == public
    assert stat.S_IMODE((keys / "server.key_secret").stat().st_mode) == 0o600
    again = _hybridd("keygen", "--dir", str(keys), "--name", "server")
    assert again.returncode == 1
    assert "refusing to overwrite" in again.stderr


def test_commands_say_clearly_that_no_daemon_runs(tmp_path):
    started = time.monotonic()
    sock_path = tmp_path / "hybridd.sock"
    no_socket = f"hybridd is not running: no daemon at ipc://{sock_path} (no socket file {sock_path})"
    status = _hybridd("status", "--runtime-dir", str(tmp_path))
    assert (status.returncode, status.stderr) == (EXIT_NOT_RUNNING, no_socket + "\n")
    generate = _hybridd("generate", "hi", "--runtime-dir", str(tmp_path))
    assert (generate.returncode, generate.stderr) == (EXIT_NOT_RUNNING, no_socket + "\n")
    stop = _hybridd("stop", "--runtime-dir", str(tmp_path))
    assert (stop.returncode, stop.stderr) == (EXIT_NOT_RUNNING, f"hybridd is not running (no live supervisor in {tmp_path})\n")
    assert time.monotonic() - started < 20


def test_commands_say_clearly_that_a_socket_is_stale(tmp_path):
    """The socket file a daemon killed with SIGKILL leaves behind: nobody listens on it."""
    sock_path = tmp_path / "hybridd.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    sock.close()
    started = time.monotonic()
    stale = (f"no daemon at ipc://{sock_path} within 0.5 s: nothing listens on {sock_path} "
             f"(a stale socket left by a daemon that died?)")
    status = _hybridd("status", "--runtime-dir", str(tmp_path), "--timeout", "0.5")
    assert (status.returncode, status.stderr) == (EXIT_NOT_RUNNING, f"hybridd is not running: {stale}\n")
    generate = _hybridd("generate", "hi", "--runtime-dir", str(tmp_path), "--connect-timeout", "0.5")
    assert (generate.returncode, generate.stderr) == (EXIT_NOT_RUNNING, f"hybridd is not running: {stale}\n")
    assert time.monotonic() - started < 20


def _next_health(client: Client, process: subprocess.Popen, deadline: float):
    error = None
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the daemon exited with {process.returncode}"
        try:
            return client.health(timeout=0.5)
        except HybriddError as exc:
            error = exc
            time.sleep(0.05)
    raise AssertionError(f"no health reply in time; the last error: {error!r}")


def _both_workers_started(supervisor: Client, process: subprocess.Popen, deadline: float) -> bool:
    assert time.monotonic() < deadline, "the workers did not start in time"
    assert process.poll() is None, f"the daemon exited with {process.returncode}"
    try:
        status = supervisor.status(timeout=0.5)
    except HybriddError:
        return False
    assert status["state"] != "ready", status  # stopped too late: the test would prove nothing
    return all(phase["phase"] not in ("starting", "stopped") for phase in status["phases"].values())


def test_health_is_ok_only_once_the_supervisor_calls_the_daemon_ready():
    """The context generator serves a moment before the supervisor has heard it and
    called the daemon ready; until then `health` is not ok, so a client that waited
    for ok never reads `capturing` from `status`. A stopped supervisor holds that
    moment open."""
    with daemon_process("--no-compile-sampler", "--heartbeat-timeout-s", "600",
                        env={"HYBRIDD_LOG_LEVEL": "warning"}) as daemon, Client(daemon.endpoint) as client:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with Client(f"{daemon.endpoint}.supervisor") as supervisor:  # up long before the workers serve
            # Stopped only once both workers run their own code: a worker still being
            # spawned waits for its parent, and the context generator for the graph's.
            while not _both_workers_started(supervisor, daemon.process, deadline):
                time.sleep(0.05)
        os.kill(daemon.process.pid, signal.SIGSTOP)
        try:
            serving = _next_health(client, daemon.process, deadline)  # only the context generator can answer now
        finally:
            os.kill(daemon.process.pid, signal.SIGCONT)
        assert not serving.ok, serving
        while not (health := _next_health(client, daemon.process, deadline)).ok:
            time.sleep(0.05)
        assert health.state == "ready"
        assert client.status()["state"] == "ready"


def test_daemon_commands_tcp_and_drain(keys):
    port = free_port()
    tcp = f"tcp://127.0.0.1:{port}"
    with run_daemon("--tcp-endpoint", tcp, "--curve-secret-key-file", str(keys / "server.key_secret"),
                    "--curve-client-keys-dir", str(keys / "clients"), "--drain-timeout-s", "40") as daemon:
        rd = str(daemon.runtime_dir)

        # status, human and JSON
        human = _hybridd("status", "--runtime-dir", rd)
        assert human.returncode == 0, human.stderr
        assert human.stdout.startswith("hybridd ready — up ")
        for line in ("model ", "workers    graph pid", "requests   running", "latency    TTFT p50", "KV blocks",
                     "decode buckets", "prefill buckets"):
            assert line in human.stdout, line
        machine = json.loads(_hybridd("status", "--runtime-dir", rd, "--json").stdout)
        assert machine["state"] == "ready" and machine["workers"]["graph"]["restarts"] == 0

        # generate: streamed text equals the SDK's greedy result; --json carries usage and timings
        with Client(daemon.endpoint) as client:
            expected = client.generate("ROMEO:", max_tokens=10, temperature=0)
        streamed = _hybridd("generate", "ROMEO:", "--runtime-dir", rd, "--max-tokens", "10", "--temperature", "0")
        assert streamed.returncode == 0, streamed.stderr
        assert streamed.stdout == expected.text + "\n"
        final = json.loads(_hybridd("generate", "ROMEO:", "--runtime-dir", rd, "--max-tokens", "6", "--seed", "3",
                                    "--top-k", "20", "--top-p", "0.9", "--repetition-penalty", "1.1",
                                    "--stop", "zzz", "--stop", "qqq", "--ignore-eos", "--json").stdout)
        assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 6
        assert set(final["timings"]) == {"ttft_s", "total_s", "queue_s"}
        bad = _hybridd("generate", "ROMEO:", "--runtime-dir", rd, "--top-p", "0")
        assert bad.returncode == 1
        assert bad.stderr.strip() == "hybridd: invalid_request: sampling.top_p: expected `float` > 0.0, got 0.0"

        # TCP: CURVE with an authorised key works, from the SDK and the CLI
        server_public, _ = load_curve_keys(str(keys / "server.key"))
        alice_public, alice_secret = load_curve_keys(str(keys / "alice.key_secret"))
        wait_until_ok(tcp, 10, server_public_key=server_public, public_key=alice_public, secret_key=alice_secret)
        with Client(tcp, server_public_key=server_public, public_key=alice_public, secret_key=alice_secret) as remote:
            assert remote.generate("ROMEO:", max_tokens=3).usage.completion_tokens == 3
        over_tcp = _hybridd("status", "--endpoint", tcp, "--server-key", str(keys / "server.key"),
                            "--client-key", str(keys / "alice.key_secret"), "--json")
        assert over_tcp.returncode == 0, over_tcp.stderr
        # ... an unknown client key, or the wrong server key, is refused at once; no keys at all up front
        mallory_public, mallory_secret = load_curve_keys(str(keys / "mallory.key_secret"))
        started = time.monotonic()
        with Client(tcp, server_public_key=server_public, public_key=mallory_public,
                    secret_key=mallory_secret) as intruder:
            for call in (intruder.health, lambda: intruder.generate("ROMEO:", max_tokens=2)):
                with pytest.raises(HandshakeRefusedError, match="it does not authorise this client's public key"):
                    call()
        with Client(tcp, server_public_key=mallory_public, public_key=alice_public,
                    secret_key=alice_secret) as misled, pytest.raises(HandshakeRefusedError, match="server_public_key"):
            misled.health()
        assert time.monotonic() - started < 10  # never the connect timeout: the monitor reports the refusal
        refused = _hybridd("generate", "ROMEO:", "--endpoint", tcp, "--server-key", str(keys / "server.key"),
                           "--client-key", str(keys / "mallory.key_secret"))
        assert (refused.returncode, refused.stderr) == (
            EXIT_REFUSED, f"hybridd: the daemon at {tcp} refused the connection: "
                          "it does not authorise this client's public key\n")
        with pytest.raises(ValueError, match="CURVE"):
            Client(tcp)

        # stop: in-flight work finishes, new work is refused with `draining`, sockets are cleaned up
        with Client(daemon.endpoint, timeout=60) as client:
            stream = client.stream("ROMEO:", max_tokens=100, ignore_eos=True)
            next(stream)
            stopper = threading.Thread(target=lambda: stopped.append(_hybridd("stop", "--runtime-dir", rd)))
            stopped: list[subprocess.CompletedProcess] = []
            stopper.start()
            deadline = time.monotonic() + 10
            refused = None
            while refused is None and time.monotonic() < deadline:
                try:
                    client.generate("ROMEO:", max_tokens=1, timeout=2)
                except DrainingError as error:
                    refused = error
                except HybriddError:
                    pass
                time.sleep(0.05)
            assert refused is not None and refused.code == "draining"
            try:
                for _ in stream:
                    pass
                assert stream.result.finish_reason == "length"
                assert stream.result.usage.completion_tokens == 100
            except RequestCancelledError:
                pytest.fail("a request within the drain timeout was cancelled")
            stopper.join(60)
        assert stopped and stopped[0].returncode == 0, stopped[0].stderr if stopped else "stop hung"
        assert stopped[0].stdout.strip() == f"hybridd (pid {daemon.process.pid}) stopped"
        assert daemon.process.wait(10) == 0
        leftovers = sorted(p.name for p in daemon.runtime_dir.iterdir() if not p.name.endswith(".lock"))
        assert leftovers == []
