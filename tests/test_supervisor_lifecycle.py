"""The supervisor's process management, end to end: a real supervisor process, real
spawned workers, the real supervisor protocol over ZeroMQ, a real sd_notify socket.

The two worker entry points below are test fixtures that follow the worker contract
(phases, heartbeats, drain → shutdown → stopped) without a model, so that restarts,
hangs and drains can be provoked on demand and take milliseconds. Knobs reach them
through `SUPFIX_*` environment variables (spawned children inherit the environment).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest
import zmq

from hybridd import exit_codes
from hybridd.protocol.codec import decode, encode
from hybridd.protocol.messages import GenerateRequest, HealthRequest, StatusRequest
from hybridd.protocol.control import Shutdown
from hybridd.protocol import codec
from hybridd.protocol.supervisor import Drain, Heartbeat, SupervisorInfo, WorkerPhase
from tests.host_load import on_this_host
from tests.processes import alive, wait_dead

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
HYBRIDD = str(Path(PYTHON).parent / "hybridd")
THIS = "tests.test_supervisor_lifecycle"


# ---------------------------------------------------------------- fixture workers (spawned)


def _fixture_dir() -> Path:
    return Path(os.environ["SUPFIX_DIR"])


def _record(name: str, data: object = "") -> None:
    # Written whole and renamed into place: the test process polls these files, and
    # must never read one half-written.
    path = _fixture_dir() / name
    partial = path.with_name(f".{name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


def _supervisor_socket(config: dict, worker: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker.encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"ipc://{config['runtime_dir']}/supervisor.sock")
    return sock


def fixture_graph(config: dict, ctl_endpoint: str) -> None:
    mode = os.environ.get("SUPFIX_MODE", "")
    _record(f"graph-{os.getpid()}.pid")
    if mode == "silent-graph":
        time.sleep(3600)
    sup = _supervisor_socket(config, "graph")
    ctl = zmq.Context.instance().socket(zmq.PAIR)
    ctl.setsockopt(zmq.LINGER, 1000)
    ctl.connect(ctl_endpoint)
    sup.send(encode(WorkerPhase(worker="graph", phase="loading", detail="loading weights")))
    if mode == "crash-graph":
        time.sleep(0.05)
        os._exit(3)
    if mode == "raise-graph":
        raise RuntimeError("a bug in the graph generator")
    total = int(os.environ.get("SUPFIX_BUCKETS", "3"))
    for done in range(1, total + 1):
        time.sleep(float(os.environ.get("SUPFIX_CAPTURE_S", "0.03")))
        sup.send(encode(WorkerPhase(worker="graph", phase="capturing", detail="capturing decode graphs",
                                    done=done, total=total)))
    while os.environ.get("SUPFIX_HOLD") and not (_fixture_dir() / "release").exists():
        time.sleep(0.05)  # still capturing, for as long as the test needs
    _record("graph-ready", time.time())
    sup.send(encode(WorkerPhase(worker="graph", phase="ready")))
    ctl.send(msgpack.packb({"fixture": "graph ready"}))
    steps = 0
    interval_ms = int(config["heartbeat_interval_s"] * 1000)
    while True:
        if ctl.poll(interval_ms) and isinstance(codec.CONTROL.decode(ctl.recv()), Shutdown):
            sup.send(encode(WorkerPhase(worker="graph", phase="stopped")))
            sup.close()
            return
        steps += 1
        sup.send(encode(Heartbeat(worker="graph", steps=steps)))


def fixture_context(config: dict, ctl_endpoint: str) -> None:
    mode = os.environ.get("SUPFIX_MODE", "")
    _record(f"context-{os.getpid()}.pid")
    ctl = zmq.Context.instance().socket(zmq.PAIR)
    ctl.setsockopt(zmq.LINGER, 1000)
    ctl.bind(ctl_endpoint)
    sup = _supervisor_socket(config, "context")
    sup.send(encode(WorkerPhase(worker="context", phase="loading", detail="waiting for the graph generator")))
    interval_ms = int(config["heartbeat_interval_s"] * 1000)
    steps = 0
    graph_ready = False
    while True:
        if not graph_ready and ctl.poll(0):
            ctl.recv()
            graph_ready = True
            _record("context-ready", time.time())
            sup.send(encode(WorkerPhase(worker="context", phase="ready")))
        if sup.poll(interval_ms):
            message = codec.SUPERVISOR_COMMANDS.decode(sup.recv())
            if isinstance(message, SupervisorInfo):
                _record("info.json", message.info.to_wire())
            elif isinstance(message, Drain):
                _record("drain.json", {"timeout_s": message.timeout_s, "at": time.time()})
                if mode == "ignore-drain":
                    continue
                sup.send(encode(WorkerPhase(worker="context", phase="draining")))
                ctl.send(encode(Shutdown()))
                sup.send(encode(WorkerPhase(worker="context", phase="stopped")))
                sup.close()
                ctl.close()
                return
        steps += 1
        sup.send(encode(Heartbeat(worker="context", steps=steps)))


# ---------------------------------------------------------------- harness


@dataclass
class Note:
    at: float
    fields: dict[str, str]


@dataclass
class NotifyListener:
    """A unix datagram socket standing in for systemd's notification socket."""

    address: str
    sock: socket.socket
    notes: list[Note] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        self.sock.settimeout(0.05)
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if line)
            self.notes.append(Note(time.time(), fields))

    def wait_for(self, predicate, timeout: float = 15.0, start: int = 0) -> Note:
        timeout = on_this_host(timeout)
        deadline = time.time() + timeout
        seen = start
        while time.time() < deadline:
            while seen < len(self.notes):
                note = self.notes[seen]
                seen += 1
                if predicate(note):
                    return note
            time.sleep(0.01)
        raise AssertionError(f"no matching notification within {timeout} s; got {[n.fields for n in self.notes]}")

    def statuses(self) -> list[str]:
        return [n.fields["STATUS"] for n in self.notes if "STATUS" in n.fields]

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


@dataclass
class Daemon:
    process: subprocess.Popen
    runtime_dir: Path
    fixture_dir: Path
    notify: NotifyListener

    def wait_ready(self, start: int = 0, timeout: float = 20.0) -> Note:
        return self.notify.wait_for(lambda n: n.fields.get("READY") == "1", timeout, start)

    def pids(self, note: Note) -> dict[str, int]:
        return {w: int(p) for w, p in re.findall(r"(graph|context) pid (\d+)", note.fields["STATUS"])}

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.process.wait(timeout)

    def stderr(self) -> str:
        return (self.fixture_dir / "stderr.log").read_text(errors="replace")

    def wait_stderr(self, text: str, timeout: float = 20.0) -> None:
        """Wait until the daemon has logged `text` to its stderr."""
        deadline = time.monotonic() + on_this_host(timeout)
        while text not in (stderr := self.stderr()):
            assert time.monotonic() < deadline, f"{text!r} not logged: {stderr}"
            time.sleep(0.02)


RUNNER = """
import json, sys, tomllib
from pathlib import Path
from hybridd.config import Config
from hybridd.supervisor import run_supervisor
from {this} import fixture_context, fixture_graph
settings, options = json.loads(sys.argv[1]), json.loads(sys.argv[2])
config = Config.from_dict(settings)
if "reload_from" in options:  # SIGHUP: the file's settings over the command line's
    path = Path(options.pop("reload_from"))
    options["reload"] = lambda: Config.from_dict(settings | tomllib.loads(path.read_text()))
sys.exit(run_supervisor(config, graph_target=fixture_graph, context_target=fixture_context,
                        **options))
""".format(this=THIS)


@pytest.fixture
def start_daemon():
    started: list[Daemon] = []
    base = Path(tempfile.mkdtemp(prefix="hs-"))

    def start(mode: str = "", *, abstract: bool = False, env: dict | None = None, options: dict | None = None,
              **settings) -> Daemon:
        runtime_dir = base / f"run{len(started)}"
        fixture_dir = base / f"fix{len(started)}"
        fixture_dir.mkdir()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            address = f"@hybridd-test-{os.getpid()}-{len(started)}"
            sock.bind(b"\0" + address[1:].encode())
        else:
            address = str(base / f"notify{len(started)}")
            sock.bind(address)
        listener = NotifyListener(address, sock)
        listener.start()
        config = {"runtime_dir": str(runtime_dir), "heartbeat_interval_s": 0.05, "max_restarts": 3,
                  "restart_backoff_s": 0.05, "drain_timeout_s": 5.0} | settings
        environment = os.environ | {"NOTIFY_SOCKET": address, "SUPFIX_DIR": str(fixture_dir), "SUPFIX_MODE": mode,
                                    "HYBRIDD_LOG_LEVEL": "info"} | (env or {})
        with (fixture_dir / "stderr.log").open("wb") as stderr:  # a file: readable while the daemon runs
            process = subprocess.Popen([PYTHON, "-c", RUNNER, json.dumps(config), json.dumps(options or {})],
                                       cwd=ROOT, env=environment, stderr=stderr)
        daemon = Daemon(process, runtime_dir, fixture_dir, listener)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        if daemon.process.poll() is None:
            daemon.process.kill()
            daemon.process.wait()
        daemon.notify.close()
        for pid_file in daemon.fixture_dir.glob("*.pid"):
            pid = int(pid_file.name.split("-")[1].split(".")[0])
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_ready_after_both_workers_then_signal_drains(start_daemon, signum):
    daemon = start_daemon(drain_timeout_s=7.5, abstract=signum == signal.SIGINT)
    ready = daemon.wait_ready()
    graph_ready = json.loads((daemon.fixture_dir / "graph-ready").read_text())
    context_ready = json.loads((daemon.fixture_dir / "context-ready").read_text())
    assert ready.at >= max(graph_ready, context_ready)
    assert sum(1 for n in daemon.notify.notes if n.fields.get("READY") == "1") == 1
    statuses = daemon.notify.statuses()
    assert statuses[0] == "starting workers"
    assert any(s.startswith("loading: graph: loading weights") for s in statuses)
    for done in (1, 2, 3):
        assert any(f"graph: capturing decode graphs {done}/3" in s for s in statuses if s.startswith("capturing"))
    assert ready.fields["STATUS"].startswith(f"ready: serving ipc://{daemon.runtime_dir}/hybridd.sock")
    pids = daemon.pids(ready)
    assert set(pids) == {"graph", "context"}
    assert (daemon.runtime_dir / "hybridd.pid").read_text().strip() == str(daemon.process.pid)
    assert (daemon.runtime_dir / "supervisor.sock").exists()
    assert oct((daemon.runtime_dir).stat().st_mode & 0o777) == oct(0o750)

    # supervisor_info reaches the context generator with the live pids.
    deadline = time.time() + 5
    while time.time() < deadline:
        info_path = daemon.fixture_dir / "info.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        if info.get("state") == "ready":
            break
        time.sleep(0.02)
    assert info["state"] == "ready"
    assert {w: info["workers"][w]["pid"] for w in pids} == pids
    assert info["workers"]["graph"]["restarts"] == 0

    mark = len(daemon.notify.notes)
    assert daemon.stop(signum) == 0
    stopping = daemon.notify.wait_for(lambda n: n.fields.get("STOPPING") == "1", start=mark)
    assert stopping.fields["STATUS"].startswith("draining")
    assert json.loads((daemon.fixture_dir / "drain.json").read_text())["timeout_s"] == 7.5
    assert daemon.notify.statuses()[-1] == "stopped"
    assert all(wait_dead(pid) for pid in pids.values())
    assert sorted(p.name for p in daemon.runtime_dir.iterdir() if not p.name.endswith(".lock")) == []


def test_killed_worker_is_detected_within_a_second_and_the_pair_restarts(start_daemon):
    daemon = start_daemon()
    first = daemon.pids(daemon.wait_ready())
    mark = len(daemon.notify.notes)
    killed_at = time.time()
    os.kill(first["graph"], signal.SIGKILL)
    degraded = daemon.notify.wait_for(lambda n: n.fields.get("STATUS", "").startswith("degraded"), start=mark)
    assert degraded.at - killed_at < on_this_host(1.0)
    assert "was killed by SIGKILL" in degraded.fields["STATUS"]
    assert wait_dead(first["context"], 2.0), "the surviving partner is stopped with the dead worker"
    second = daemon.pids(daemon.wait_ready(start=mark))
    assert second["graph"] != first["graph"] and second["context"] != first["context"]
    assert "restarts 1" in daemon.notify.notes[-1].fields["STATUS"] or any(
        "restarts 1" in s for s in daemon.notify.statuses())
    assert daemon.stop() == 0


def test_restarts_exhausted_exits_non_zero(start_daemon):
    daemon = start_daemon("crash-graph", max_restarts=2, restart_backoff_s=0.05)
    assert daemon.process.wait(20) == 5
    statuses = daemon.notify.statuses()
    assert statuses[-1].startswith("dead: graph generator")
    assert "exited with code 3" in statuses[-1]
    assert len(list(daemon.fixture_dir.glob("graph-*.pid"))) == 3  # the first pair and 2 restarts
    backoffs = [float(m) for s in statuses for m in re.findall(r"restart \d/2 in ([\d.]+) s", s)]
    assert backoffs == [0.05, 0.1]  # exponential
    assert not (daemon.runtime_dir / "hybridd.pid").exists()


def test_hung_worker_stops_the_watchdog_and_is_restarted(start_daemon):
    daemon = start_daemon(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.2, env={"WATCHDOG_USEC": "100000"})
    first = daemon.pids(daemon.wait_ready())
    daemon.notify.wait_for(lambda n: n.fields.get("WATCHDOG") == "1")  # the watchdog is fed while healthy
    mark = len(daemon.notify.notes)
    stopped_at = time.time()
    os.kill(first["graph"], signal.SIGSTOP)
    degraded = daemon.notify.wait_for(lambda n: n.fields.get("STATUS", "").startswith("degraded"), start=mark)
    assert "missed heartbeats for 1.2 s" in degraded.fields["STATUS"]
    # The last heartbeat may have left up to one interval (0.1 s) before the stop.
    assert 1.05 <= degraded.at - stopped_at < 1.05 + on_this_host(0.95)
    pings = [n.at for n in daemon.notify.notes[mark:] if n.fields.get("WATCHDOG") == "1" and n.at < degraded.at]
    # At most the pings of the first 3 heartbeat intervals after the stall.
    assert all(at - stopped_at < on_this_host(0.6) for at in pings), pings
    assert wait_dead(first["graph"], 2.0)
    daemon.wait_ready(start=mark)
    assert daemon.stop() == 0


def test_worker_not_ready_within_the_startup_timeout_counts_as_failed(start_daemon):
    daemon = start_daemon("silent-graph", max_restarts=0, startup_timeout_s=1.0)
    started = time.time()
    assert daemon.process.wait(10) == 5
    assert 1.0 <= time.time() - started < 1.0 + on_this_host(5.0)
    assert "graph generator was not ready within startup_timeout_s = 1 s (graph: " in daemon.notify.statuses()[-1]


def test_drain_deadline_kills_a_context_generator_that_does_not_stop(start_daemon):
    daemon = start_daemon("ignore-drain", drain_timeout_s=0.3, options={"drain_grace_s": 0.2})
    pids = daemon.pids(daemon.wait_ready())
    sent = time.time()
    daemon.process.send_signal(signal.SIGTERM)
    assert daemon.process.wait(10) == 1  # forced
    assert 0.5 <= time.time() - sent < 0.5 + on_this_host(2.5)
    assert (daemon.fixture_dir / "drain.json").exists()
    assert all(wait_dead(pid) for pid in pids.values())


def test_second_supervisor_is_refused_and_stop_command_drains(start_daemon):
    daemon = start_daemon()
    daemon.wait_ready()
    second = subprocess.run([HYBRIDD, "start", "--runtime-dir", str(daemon.runtime_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
    assert second.returncode == 3
    assert f"already running in {daemon.runtime_dir} (pid {daemon.process.pid}" in second.stderr
    assert daemon.process.poll() is None, "the first daemon is unaffected"

    stop = subprocess.run([HYBRIDD, "stop", "--runtime-dir", str(daemon.runtime_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert stop.returncode == 0, stop.stderr
    assert f"hybridd (pid {daemon.process.pid}) stopped" in stop.stdout
    assert daemon.process.wait(5) == 0

    again = subprocess.run([HYBRIDD, "stop", "--runtime-dir", str(daemon.runtime_dir)], cwd=ROOT,
                           capture_output=True, text=True, timeout=30)
    assert again.returncode == exit_codes.NOT_RUNNING
    assert again.stderr.strip() == f"hybridd is not running (no live supervisor in {daemon.runtime_dir})"


def test_killing_workers_until_the_budget_is_spent_ends_with_one_line_and_exit_5(start_daemon):
    daemon = start_daemon(max_restarts=2, restart_backoff_s=0.05)
    mark = 0
    for kill in range(3):  # two restarts, then the third death is one too many
        note = daemon.wait_ready(start=mark)
        mark = len(daemon.notify.notes)
        os.kill(daemon.pids(note)["context" if kill % 2 else "graph"], signal.SIGKILL)
    assert daemon.process.wait(20) == 5
    stderr = daemon.stderr()
    assert "Traceback" not in stderr and "LifecycleError" not in stderr, stderr
    assert len([line for line in stderr.splitlines() if "restarts exhausted" in line]) == 1
    assert daemon.notify.statuses()[-1].startswith("dead: ")
    assert not (daemon.runtime_dir / "hybridd.pid").exists()


def test_sighup_reloads_the_log_level_and_keeps_serving(start_daemon, tmp_path):
    config_file = tmp_path / "hybridd.toml"
    config_file.write_text('log_level = "info"\n')
    daemon = start_daemon(options={"reload_from": str(config_file)})
    pids = daemon.pids(daemon.wait_ready())
    def edit(text: str) -> None:  # whole, as editors save: the supervisor never reads half a file
        partial = tmp_path / "partial.toml"
        partial.write_text(text)
        os.replace(partial, config_file)

    edit('log_level = "debug"\nmax_batch = 8\n')
    daemon.process.send_signal(signal.SIGHUP)
    daemon.wait_stderr("SIGHUP: configuration reloaded")
    edit('log_level = "verbose"\n')  # a bad edit is refused, not fatal
    daemon.process.send_signal(signal.SIGHUP)
    daemon.wait_stderr("SIGHUP: configuration not reloaded")
    assert daemon.process.poll() is None, "SIGHUP does not end the daemon"
    assert all(alive(pid) for pid in pids.values()), "nor its workers"
    assert daemon.stop() == 0
    stderr = daemon.stderr()
    reloaded = [line for line in stderr.splitlines() if "SIGHUP: configuration reloaded" in line]
    assert len(reloaded) == 1, stderr
    assert "log_level=debug" in reloaded[0] and "needs_restart=['decode_buckets', 'max_batch']" in reloaded[0]
    refused = [line for line in stderr.splitlines() if "SIGHUP: configuration not reloaded" in line]
    assert len(refused) == 1 and "verbose" in refused[0]


def _ask(endpoint: str, request) -> dict:
    """One request on a raw DEALER, as a client written from the spec would send it."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode(request))
        assert sock.poll(5000), f"no answer from {endpoint}"
        return decode(sock.recv())
    finally:
        sock.close()


def test_the_supervisor_answers_from_its_first_second_while_the_workers_cannot(start_daemon):
    daemon = start_daemon(env={"SUPFIX_HOLD": "1"})
    fallback = f"ipc://{daemon.runtime_dir}/hybridd.sock.supervisor"
    deadline = time.time() + 15
    while not (daemon.runtime_dir / "hybridd.sock.supervisor").exists():
        assert time.time() < deadline
        time.sleep(0.01)
    health = _ask(fallback, HealthRequest(id="h"))
    assert health["type"] == "health_reply" and health["state"] in ("starting", "loading", "capturing")
    assert health["ok"] is False
    daemon.notify.wait_for(lambda n: "capturing decode graphs 3/3" in n.fields.get("STATUS", ""))
    status = _ask(fallback, StatusRequest(id="s"))["status"]
    assert status["state"] == "capturing" and status["source"] == "supervisor"
    graph = status["phases"]["graph"]
    assert graph["phase"] == "capturing" and graph["detail"] == "capturing decode graphs" and graph["total"] == 3
    assert graph["elapsed_s"] >= 0 and status["restarts"] == 0 and status["last_restart_reason"] is None
    assert status["cuda_mps"] in ("off (CPU device)", "off (nvidia-cuda-mps-control is not on PATH)")
    assert status["endpoints"]["ipc"] == f"ipc://{daemon.runtime_dir}/hybridd.sock"
    refused = _ask(fallback, GenerateRequest(id="g", prompt="hi"))
    assert (refused["type"], refused["id"], refused["code"]) == ("error", "g", "unavailable")
    assert refused["message"].startswith("the daemon is not serving: capturing: graph: capturing decode graphs ")

    (daemon.fixture_dir / "release").write_text("")
    first = daemon.pids(daemon.wait_ready())
    health = _ask(fallback, HealthRequest(id="h"))
    assert (health["state"], health["ok"]) == ("ready", False)  # only the client endpoint serves
    mark = len(daemon.notify.notes)
    os.kill(first["graph"], signal.SIGKILL)
    daemon.notify.wait_for(lambda n: n.fields.get("STATUS", "").startswith("degraded"), start=mark)
    status = _ask(fallback, StatusRequest(id="s"))["status"]
    assert status["state"] == "degraded"
    assert status["last_restart_reason"] == f"graph generator (pid {first['graph']}) was killed by SIGKILL"
    daemon.wait_ready(start=mark)
    assert _ask(fallback, StatusRequest(id="s"))["status"]["restarts"] == 1
    assert daemon.stop() == 0
    assert not (daemon.runtime_dir / "hybridd.sock.supervisor").exists()


def test_sdk_and_cli_fall_back_to_the_supervisor_while_the_workers_cannot_serve(start_daemon):
    from hybridd import Client, UnavailableError

    daemon = start_daemon(env={"SUPFIX_HOLD": "1"})
    endpoint = f"ipc://{daemon.runtime_dir}/hybridd.sock"  # never bound by the fixture workers
    daemon.notify.wait_for(lambda n: "capturing decode graphs 3/3" in n.fields.get("STATUS", ""))
    with Client(endpoint, connect_timeout=5) as client:
        health = client.health()
        assert (health.state, health.ok) == ("capturing", False)
        status = client.status()
        assert status["source"] == "supervisor" and status["phases"]["graph"]["phase"] == "capturing"
        with pytest.raises(UnavailableError, match="the daemon is not serving: capturing: graph: capturing"):
            client.generate("hi", max_tokens=2)
        with pytest.raises(UnavailableError, match="the daemon is not serving: capturing"):
            next(iter(client.stream("hi", max_tokens=2)))
        started = time.monotonic()
        with pytest.raises(UnavailableError, match=r"not ready within 0.5 s \(last seen: capturing\)"):
            client.wait_ready(0.5)
        assert time.monotonic() - started < on_this_host(3.0)

        env = os.environ | {"HYBRIDD_LOG_LEVEL": "warning"}
        shown = subprocess.run([HYBRIDD, "status", "--runtime-dir", str(daemon.runtime_dir)], capture_output=True,
                               text=True, timeout=30, env=env)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.splitlines()[0].startswith("hybridd capturing — up ")
        assert "graph      capturing: capturing decode graphs " in shown.stdout
        refused = subprocess.run([HYBRIDD, "generate", "hi", "--runtime-dir", str(daemon.runtime_dir)],
                                 capture_output=True, text=True, timeout=30, env=env)
        assert refused.returncode == 8
        assert refused.stderr.startswith("hybridd: generate: unavailable: the daemon is not serving: capturing")
        assert len(refused.stderr.strip().splitlines()) == 1

        (daemon.fixture_dir / "release").write_text("")
        daemon.wait_ready()
        health = client.health()  # the fixture workers never bind the client endpoint
        assert (health.state, health.ok) == ("ready", False)
    assert daemon.stop() == 0


def test_json_logs_are_json_on_every_line_worker_tracebacks_included(start_daemon):
    daemon = start_daemon("raise-graph", max_restarts=0, log_format="json")
    assert daemon.process.wait(30) == 5
    records = [json.loads(line) for line in daemon.stderr().splitlines()]
    failed = [r for r in records if r["event"] == "worker failed"]
    assert failed and failed[0]["component"] == "graph_generator"
    assert failed[0]["error"] == "RuntimeError: a bug in the graph generator"
    assert "Traceback (most recent call last)" in failed[0]["exception"]
    assert any(r["event"] == "restarts exhausted; exiting so that the service manager can act" for r in records)


def test_processes_carry_their_role_as_title(start_daemon):
    pytest.importorskip("setproctitle")
    daemon = start_daemon()
    pids = daemon.pids(daemon.wait_ready())

    def title(pid: int) -> str:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()

    assert title(daemon.process.pid) == "hybridd: supervisor"
    assert title(pids["graph"]) == "hybridd: graph-generator"
    assert title(pids["context"]) == "hybridd: context-generator"
    assert daemon.stop() == 0


def test_sigterm_while_starting_stops_at_once(start_daemon):
    daemon = start_daemon(env={"SUPFIX_HOLD": "1"}, drain_timeout_s=60.0)
    daemon.notify.wait_for(lambda n: n.fields.get("STATUS", "").startswith("capturing"))
    sent = time.time()
    assert daemon.stop() == 0
    assert time.time() - sent < on_this_host(5.0), "nothing to drain: the workers are stopped, not waited for"
