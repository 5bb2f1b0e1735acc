"""The supervisor process (`hybridd start`): owns the two workers' lives.

It holds the pid-file lock of the runtime directory (one daemon per directory),
spawns the graph generator and the context generator with the `spawn` start method,
listens to their phases and heartbeats on a ROUTER socket, drives the lifecycle
(`hybridd.lifecycle`), tells systemd about it (`hybridd.sd_notify`), restarts the
pair with bounded backoff when a worker dies or hangs, and drains on SIGTERM/SIGINT.

One thread, one `zmq.Poller` over the ROUTER socket, the workers' process sentinels
and the signal wakeup pipe: a worker's death wakes the loop at once, the same way
`multiprocessing.connection.wait` would, without a second thread for the socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import zmq

from hybridd import environment, exit_codes
from hybridd.child_process import die_with_parent, set_process_title
from hybridd.config import Config
from hybridd.cuda_mps import MpsDaemon, start_for
from hybridd.fallback_endpoint import FallbackEndpoint
from hybridd.gateway import supervised as supervised_gateway
from hybridd.lifecycle import Lifecycle, State
from hybridd.log import configure as configure_logging
from hybridd.log import get_logger
from hybridd.sd_notify import Notifier, watchdog_interval_s
from hybridd.version import __version__
from hybridd.ipc.channel import MAX_IPC_PATH_BYTES, PeerProtocolError, bind_ipc_endpoint, ensure_runtime_dir
from hybridd.ipc import pid_lock
from hybridd.ipc.posix_shm import reap_stale_segments
from hybridd.protocol import codec
from hybridd.protocol.supervisor import (
    WORKER_IDENTITIES,
    MAX_FAILURE_CHARS,
    WORKER_NAMES,
    Drain,
    Heartbeat,
    Reconfigure,
    SupervisorInfo,
    SupervisorStatus,
    WorkerInfo,
    WorkerPhase,
)
from hybridd.workers import entry_points

log = get_logger("supervisor")

SPAWN = multiprocessing.get_context("spawn")
PID_FILE_NAME = "hybridd.pid"

# A worker's entry point: called with the config (as a dict) and the control endpoint
# in a fresh spawned process; it must be importable by name (spawn pickles the reference).
WorkerTarget = Callable[[dict[str, Any], str], Any]
DEFAULT_TARGETS: dict[str, WorkerTarget] = {
    "graph": entry_points.graph_generator,
    "context": entry_points.context_generator,
}
# Two deadlines judge a worker (both settings): until it reports `ready` it has
# `startup_timeout_s` from its spawn (loading, compiling and capturing are single long
# calls; a background thread keeps beating through them); once it serves, its loop
# must beat at least every `heartbeat_timeout_s`. A dead process is caught by its
# sentinel at once either way.
# systemd's watchdog is fed only while both serving loops heartbeated within this
# many intervals: a stalled worker stops the pings long before it is declared hung.
WATCHDOG_FRESH_INTERVALS = 3
# When one worker dies, the other gets SIGTERM and this long to answer its clients
# (engine_dead) and exit before SIGKILL.
PARTNER_GRACE_S = 1.0
# Beyond `drain_timeout_s`: time for the context generator to cancel what is left,
# shut the graph generator down and exit.
DRAIN_GRACE_S = 10.0
INFO_INTERVAL_S = 2.0
POLL_INTERVAL_MS = 100
# SIGTERM and SIGINT drain; SIGHUP reloads what can change without a restart.
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
RELOADABLE = frozenset({"log_level", "log_format"})

EXIT_OK = exit_codes.OK
EXIT_FAILURE = exit_codes.ERROR  # the drain had to be forced
EXIT_ALREADY_RUNNING = exit_codes.ALREADY_RUNNING
EXIT_STARTUP_FAILED = exit_codes.STARTUP_FAILED
EXIT_RESTARTS_EXHAUSTED = exit_codes.RESTARTS_EXHAUSTED



class AlreadyRunningError(RuntimeError):
    """Another supervisor holds this runtime directory (or serves its endpoint)."""


# ---------------------------------------------------------------- the pid file


class PidFile:
    """`{runtime_dir}/hybridd.pid`: the supervisor's pid lock file (`hybridd.ipc.pid_lock`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self._fd = pid_lock.acquire(self.path)
        except pid_lock.LockHeldError as held:
            raise AlreadyRunningError(
                f"hybridd is already running in {self.path.parent} (pid {held.holder}, lock {self.path}); "
                "stop it with `hybridd stop`, or configure another runtime_dir"
            ) from None

    def release(self) -> None:
        if self._fd is not None:
            pid_lock.release(self.path, self._fd)
            self._fd = None


def running_pid(runtime_dir: str | os.PathLike[str]) -> int | None:
    """The pid of the supervisor that holds `runtime_dir`, or None when none does."""
    return pid_lock.holder(Path(runtime_dir) / PID_FILE_NAME) or None


def _endpoint_locked(endpoint: str) -> bool:
    """True when a live server holds the lock next to an `ipc://` endpoint (see ipc.channel)."""
    if not endpoint.startswith("ipc://"):
        return False
    return pid_lock.holder(Path(endpoint.removeprefix("ipc://") + ".lock")) is not None


# ---------------------------------------------------------------- the worker side


WORKER_TITLES = {"graph": "hybridd: graph-generator", "context": "hybridd: context-generator"}


def worker_main(name: str, target: WorkerTarget, config: dict[str, Any], ctl_endpoint: str, parent_pid: int) -> None:
    """First code of a spawned worker, before its entry point."""
    # If the supervisor is SIGKILLed, its workers must not keep the GPU (and the client
    # socket) to themselves.
    if not die_with_parent(parent_pid):  # the supervisor died before the signal was asked for
        os._exit(EXIT_FAILURE)
    set_process_title(WORKER_TITLES.get(name, f"hybridd: {name}"))
    # Ctrl-C, `timeout`, `kill -- -PGID` or a KillMode=control-group stop signal the
    # whole process group; only the supervisor decides what that means (a drain) and
    # tells the workers. It stops a worker the hard way with SIGKILL, never SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the supervisor reloads; workers follow its messages
    # Blocked before any thread starts (each inherits the mask), so that a worker that
    # takes SIGTERM takes it on one thread, where its sender is known (workers/loop_exit.py).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    configure_logging(level=config.get("log_level"), json=config.get("log_format") == "json")
    worker_log = log.bind(component=f"{name}_generator", pid=os.getpid())
    try:
        target(config, ctl_endpoint)
    except Exception as error:
        from hybridd.workers import startup_errors

        if startup_errors.is_permanent(error):
            # The supervisor logs the one line that explains it; the traceback is for debugging.
            worker_log.debug("start-up error", error=str(error), exc_info=True)
            code = EXIT_STARTUP_FAILED
        else:
            worker_log.error("worker failed", error=f"{type(error).__name__}: {error}", exc_info=True)
            code = EXIT_FAILURE
        _flush_sockets()
        sys.exit(code)
    _flush_sockets()


def _flush_sockets() -> None:
    # Messages still queued (a `failed` report, `stopped`) leave before the process ends.
    zmq.Context.instance().destroy(linger=500)


# ---------------------------------------------------------------- the supervisor


@dataclass(slots=True)
class _Worker:
    name: str
    process: BaseProcess
    spawned_at: float
    last_message: float | None = None
    serving: bool = False  # reported `ready`: from now on its loop's heartbeats are judged
    steps: int = 0
    exit_code: int | None = None

    @property
    def alive(self) -> bool:
        return self.exit_code is None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    if code == 0:
        return "exited with code 0 without being asked to stop (its log says why it left its serving loop)"
    return f"exited with code {code}"


@dataclass
class _Timers:
    next_watchdog: float = 0.0
    next_info: float = 0.0
    drain_deadline: float | None = None
    signals: list[int] = field(default_factory=list)


class Supervisor:
    """Runs the daemon until it is drained (exit 0) or its restarts are exhausted (exit 1)."""

    def __init__(
        self,
        config: Config,
        *,
        graph_target: WorkerTarget = DEFAULT_TARGETS["graph"],
        context_target: WorkerTarget = DEFAULT_TARGETS["context"],
        notifier: Notifier | None = None,
        stable_after_s: float | None = None,
        drain_grace_s: float = DRAIN_GRACE_S,
        reload: Callable[[], Config] | None = None,
    ) -> None:
        self.config = config
        self.targets: dict[str, WorkerTarget] = {"graph": graph_target, "context": context_target}
        self.notifier = notifier or Notifier()
        self.runtime_dir = Path(config.runtime_dir)
        self.heartbeat_timeout_s = config.heartbeat_timeout_s
        self.startup_timeout_s = config.startup_timeout_s
        self.watchdog_fresh_s = WATCHDOG_FRESH_INTERVALS * config.heartbeat_interval_s
        self.drain_grace_s = drain_grace_s
        self._reload = reload
        lifecycle_options = {} if stable_after_s is None else {"stable_after_s": stable_after_s}
        self.lifecycle = Lifecycle(
            max_restarts=config.max_restarts, restart_backoff_s=config.restart_backoff_s, **lifecycle_options
        )
        self.workers: dict[str, _Worker] = {}
        self.generation = 0
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self._pid_file = PidFile(self.runtime_dir / PID_FILE_NAME)
        self._timers = _Timers()
        self._watchdog_s = watchdog_interval_s()
        self._router = None
        self._fallback: FallbackEndpoint | None = None
        self._mps: MpsDaemon | None = None
        self._mps_status = ""
        self.gateway = supervised_gateway.SupervisedGateway(
            self._spawn_gateway, max_restarts=config.max_restarts, restart_backoff_s=config.restart_backoff_s,
            **lifecycle_options,
        ) if config.serves_http else None
        self._saved_env: dict[str, str | None] = {}
        self._wakeup_r = self._wakeup_w = -1
        self._exit_code = EXIT_OK
        self._done = False
        self._log = log.bind(supervisor_pid=os.getpid())

    # ------------------------------------------------------------ entry

    def run(self) -> int:
        ensure_runtime_dir(self.runtime_dir)
        self._pid_file.acquire()  # raises AlreadyRunningError
        try:
            if _endpoint_locked(self.config.client_endpoint):
                raise AlreadyRunningError(
                    f"endpoint {self.config.client_endpoint} is already served by a live process; "
                    "stop it, or configure another endpoint or runtime_dir"
                )
            self._log.info("supervisor starting", runtime_dir=str(self.runtime_dir), endpoint=self.config.client_endpoint)
            reap_stale_segments()
            self._router = bind_ipc_endpoint(
                self.config.supervisor_endpoint.removeprefix("ipc://"), socket_type=zmq.ROUTER,
                decoder=codec.WORKER_REPORTS, name="supervisor",
            )
            # A restarted worker reconnects with the same identity before the ROUTER
            # may have noticed that the dead one's connection is gone.
            self._router.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._fallback = FallbackEndpoint(self.config.client_endpoint, self.status, self._unavailable_text)
            self._install_signals()
            self._notify_status()
            self._start_mps()
            self._spawn_pair()
            if self.gateway is not None:
                self.gateway.start()
            self._loop()
        finally:
            self._shutdown()
        return self._exit_code

    # ------------------------------------------------------------ signals

    def _install_signals(self) -> None:
        self._wakeup_r, self._wakeup_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self._wakeup_w, warn_on_full_buffer=False)
        for signum in HANDLED_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._timers.signals.append(signum)

    def _restore_signals(self) -> None:
        if self._wakeup_w < 0:
            return
        for signum in HANDLED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.close(self._wakeup_r)
        os.close(self._wakeup_w)
        self._wakeup_r = self._wakeup_w = -1

    # ------------------------------------------------------------ the pair

    def _start_mps(self) -> None:
        """Start the private MPS daemon the configuration asks for; spawned workers
        inherit its directories."""
        self._mps, self._mps_status = start_for(self.config.cuda_mps, self.config.device, self.runtime_dir)
        if self._mps is None:
            return
        self._saved_env.update(environment.export(self._mps.env))

    def _stop_mps(self) -> None:
        if self._mps is None:
            return
        self._mps.stop()
        environment.restore(self._saved_env)
        self._saved_env.clear()

    def _ctl_endpoint(self) -> str:
        return f"ipc://{self.runtime_dir}/ctl-{os.getpid()}-{self.generation}.sock"

    def _spawn_pair(self) -> None:
        reap_stale_segments()
        self.generation += 1
        self.lifecycle.pair_started()
        ctl_endpoint = self._ctl_endpoint()
        if len(os.fsencode(ctl_endpoint.removeprefix("ipc://"))) > MAX_IPC_PATH_BYTES:
            raise ValueError(f"runtime_dir {self.runtime_dir} is too long for a Unix socket path ({ctl_endpoint})")
        config = self.config.to_dict()
        now = time.monotonic()
        # The context generator binds the control socket, so it starts first.
        for name in ("context", "graph"):
            process = SPAWN.Process(
                target=worker_main,
                args=(name, self.targets[name], config, ctl_endpoint, os.getpid()),
                name=f"hybridd-{name}",
                daemon=False,
            )
            process.start()
            self.workers[name] = _Worker(name=name, process=process, spawned_at=now)
        self._log.info(
            "spawned workers",
            generation=self.generation,
            pids={name: w.process.pid for name, w in self.workers.items()},
            ctl_endpoint=ctl_endpoint,
        )
        self._notify_status()
        self._send_info()

    def _spawn_gateway(self) -> BaseProcess:
        process = SPAWN.Process(
            target=worker_main,
            args=(supervised_gateway.NAME, supervised_gateway.TARGET, self.config.to_dict(),
                  self.config.supervisor_endpoint, os.getpid()),
            name="hybridd-gateway",
            daemon=False,
        )
        process.start()
        return process

    def _kill_pair(self, *, culprit: str | None = None, grace_s: float = PARTNER_GRACE_S) -> None:
        """Stop whatever is left of the pair: the culprit at once (SIGKILL), the partner
        politely (SIGTERM: time to answer its clients `engine_dead`), SIGKILL after a grace."""
        for worker in self.workers.values():
            if worker.alive and worker.process.exitcode is None:
                if worker.name == culprit or grace_s <= 0:
                    worker.process.kill()
                else:
                    worker.process.terminate()
        deadline = time.monotonic() + grace_s
        for worker in self.workers.values():
            if worker.alive:
                worker.process.join(max(0.0, deadline - time.monotonic()))
                if worker.process.exitcode is None:
                    self._log.warning("killing worker", worker=worker.name, pid=worker.process.pid)
                    worker.process.kill()
            worker.process.join()
            worker.exit_code = worker.process.exitcode
            worker.process.close()
        self.workers = {}
        for suffix in ("", ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ctl_endpoint().removeprefix("ipc://") + suffix)
        # A killed context generator leaves its client socket file behind; nobody holds
        # its lock now (the pid file keeps other supervisors out), so it is stale.
        client = self.config.client_endpoint
        if client.startswith("ipc://") and not _endpoint_locked(client):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(client.removeprefix("ipc://"))
        reap_stale_segments()

    def _startup_failed(self, worker: _Worker, reason: str) -> None:
        """A worker found an error that no restart can fix: one line, stop, a distinct exit code."""
        self.lifecycle.fatal(reason)
        self._log.error("cannot start: " + reason, worker=worker.name, exit_code=EXIT_STARTUP_FAILED)
        self._notify_status()
        self._kill_pair(culprit=worker.name)
        self._exit_code = EXIT_STARTUP_FAILED
        self._done = True

    def _pair_failed(self, culprit: str, reason: str) -> None:
        self._log.error("worker failed", worker=culprit, reason=reason, generation=self.generation)
        # The state and systemd's STATUS change at detection; the backoff counts from
        # here too, so that the partner's grace period is part of it.
        failure = self.lifecycle.failed(reason)
        self._notify_status()
        self._kill_pair(culprit=culprit)
        if self.lifecycle.state == State.DEAD:
            self._log.error(
                "restarts exhausted; exiting so that the service manager can act",
                max_restarts=self.config.max_restarts,
                reason=reason,
                exit_code=EXIT_RESTARTS_EXHAUSTED,
            )
            self._exit_code = EXIT_RESTARTS_EXHAUSTED
            self._done = True
        else:
            self._log.warning("restarting workers", backoff_s=failure.backoff_s, streak=self.lifecycle.failure_streak)

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router.socket, zmq.POLLIN)
        poller.register(self._wakeup_r, zmq.POLLIN)
        if self._fallback.socket is not None:
            poller.register(self._fallback.socket, zmq.POLLIN)
        registered: dict[int, str] = {}
        while not self._done:
            sentinels = {w.process.sentinel: w.name for w in self.workers.values() if w.alive}
            if self.gateway is not None and self.gateway.sentinel is not None:
                sentinels[self.gateway.sentinel] = supervised_gateway.NAME
            for fd in set(registered) - set(sentinels):
                poller.unregister(fd)
            for fd in set(sentinels) - set(registered):
                poller.register(fd, zmq.POLLIN)
            registered = sentinels
            events = dict(poller.poll(POLL_INTERVAL_MS))
            if self._wakeup_r in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wakeup_r, 512)
            if self._router.socket in events:
                self._read_messages()
            if self._fallback.socket is not None and self._fallback.socket in events:
                self._fallback.answer()
            for fd, name in sentinels.items():
                if fd in events and name in self.workers:
                    self._worker_exited(self.workers[name])
                elif fd in events and name == supervised_gateway.NAME:
                    self._gateway_exited()
                if self._done:
                    break
            while self._timers.signals and not self._done:
                signum = self._timers.signals.pop(0)
                if signum == signal.SIGHUP:
                    self._on_reload()
                else:
                    self._on_drain_signal(signum)
            if not self._done:
                self._tick()

    def _read_messages(self) -> None:
        while True:
            try:
                received = self._router.recv_from(0)
            except PeerProtocolError as error:
                self._log.warning("bad message from a worker", identity=error.identity, error=str(error))
                continue
            if received is None:
                return
            identity, message = received
            if WORKER_IDENTITIES.get(message.worker) != identity:
                self._log.warning("message from the wrong peer", identity=identity, type=type(message).__name__)
                continue
            worker = self.workers.get(message.worker)
            if worker is None or not worker.alive:
                continue  # a straggler of a pair that is already gone
            worker.last_message = time.monotonic()
            if isinstance(message, Heartbeat):
                worker.steps = message.steps
            elif isinstance(message, WorkerPhase) and message.phase == "failed":
                self._startup_failed(worker, message.detail)
                return
            elif isinstance(message, WorkerPhase):
                worker.serving = worker.serving or message.phase == "ready"
                self._on_phase(message)

    def _on_phase(self, message: WorkerPhase) -> None:
        self._log.info("worker phase", worker=message.worker, phase=message.phase, detail=message.detail,
                       done=message.done, total=message.total)
        was = self.lifecycle.state
        changed = self.lifecycle.phase(message)
        if changed and self.lifecycle.state == State.READY:
            self._log.info("ready", pids=self._pids(), restarts=self.lifecycle.restarts,
                           startup_s=round(time.monotonic() - self._started_mono, 3) if was != State.DEGRADED else None)
            self.notifier.ready(self._status_text())
        else:
            self._notify_status()
        if changed:
            self._send_info()

    def _worker_exited(self, worker: _Worker) -> None:
        worker.process.join(0)
        code = worker.process.exitcode
        if code is None:
            return
        if code == EXIT_STARTUP_FAILED and self.lifecycle.state != State.DRAINING:
            # Its `failed` report left before it exited: read it for the reason.
            if self._router.socket.poll(500):
                self._read_messages()
            if not self._done:
                self._startup_failed(worker, f"{worker.name} generator reported a start-up error (see its log)")
            return
        worker.exit_code = code
        if self.lifecycle.state == State.DRAINING:
            level = self._log.info if worker.exit_code == 0 else self._log.warning
            level("worker exited while draining", worker=worker.name, exit_code=worker.exit_code)
            if not any(w.alive for w in self.workers.values()):
                self._finish_drain(forced=False)
            return
        self._pair_failed(worker.name, f"{worker.name} generator (pid {worker.process.pid}) {_describe_exit(worker.exit_code)}")

    def _gateway_exited(self) -> None:
        assert self.gateway is not None
        self.gateway.exited()
        if self.gateway.given_up:
            self._log.error("giving up: the gateway cannot stay up; exiting so that the service manager can act",
                            exit_code=EXIT_RESTARTS_EXHAUSTED)
            self._exit_code = EXIT_RESTARTS_EXHAUSTED
            self._done = True
        self._send_info()

    def _tick(self) -> None:
        now = time.monotonic()
        self.lifecycle.tick()
        if self.gateway is not None and self.lifecycle.state != State.DRAINING:
            self.gateway.tick()
        if self.lifecycle.state == State.DRAINING:
            if self._timers.drain_deadline is not None and now >= self._timers.drain_deadline:
                self._log.warning("drain deadline passed; killing workers", pids=self._pids())
                self._kill_pair(grace_s=0.0)
                self._finish_drain(forced=True)
                return
        else:
            # The graph generator first: the context generator waits for it while starting.
            for worker in [self.workers[name] for name in WORKER_NAMES if name in self.workers]:
                if not worker.alive:
                    continue
                if not worker.serving and now - worker.spawned_at > self.startup_timeout_s:
                    self._pair_failed(worker.name, f"{worker.name} generator was not ready within "
                                                   f"startup_timeout_s = {self.startup_timeout_s:g} s "
                                                   f"({self.lifecycle.phase_text(worker.name)})")
                    return
                if worker.serving and now - (worker.last_message or 0.0) > self.heartbeat_timeout_s:
                    self._pair_failed(worker.name, f"{worker.name} generator missed heartbeats for "
                                                   f"{self.heartbeat_timeout_s:g} s (hung)")
                    return
            if self.lifecycle.restart_due():
                self._spawn_pair()
        if self._watchdog_s is not None and now >= self._timers.next_watchdog:
            if self._making_progress(now):
                self.notifier.watchdog()
                self._timers.next_watchdog = now + self._watchdog_s
        if now >= self._timers.next_info:
            self._send_info()

    def _making_progress(self, now: float) -> bool:
        """Whether to tell systemd's watchdog we are alive.

        True while both serving loops heartbeat (each within the last few intervals),
        and during the supervisor's own bounded waits (restart backoff, a worker's
        start-up, the drain deadline): each of those ends by a timeout enforced here, and feeding the watchdog through them keeps systemd from
        restarting the whole service while the supervisor is already restarting the
        pair. A stalled worker stops the pings until it is caught.
        """
        if self.lifecycle.restart_pending or self.lifecycle.state == State.DRAINING:
            return True
        if len(self.workers) != len(WORKER_NAMES):
            return False
        for worker in self.workers.values():
            if not worker.alive:
                return False
            if not worker.serving:
                if now - worker.spawned_at > self.startup_timeout_s:
                    return False
            elif now - (worker.last_message or 0.0) > self.watchdog_fresh_s:
                return False
        return True

    # ------------------------------------------------------------ reload

    def _on_reload(self) -> None:
        """SIGHUP: re-read the configuration; apply what applies without a restart (the log
        level and format, here and in both workers) and name the rest."""
        if self._reload is None:
            self._log.warning("SIGHUP: no configuration to reload; nothing changed")
            return
        try:
            new = self._reload()
        except Exception as error:  # noqa: BLE001 (a bad edit must not take the daemon down)
            self._log.error("SIGHUP: configuration not reloaded; nothing changed", error=str(error))
            return
        old = self.config
        changed = sorted(f.name for f in dataclasses.fields(Config) if getattr(new, f.name) != getattr(old, f.name))
        applied = [name for name in changed if name in RELOADABLE]
        old.log_level, old.log_format = new.log_level, new.log_format
        configure_logging(level=new.log_level, json=new.log_format == "json")
        message = Reconfigure(log_level=new.log_level, log_format=new.log_format)
        for name, worker in self.workers.items():
            if worker.alive and worker.last_message is not None:
                self._router.send_to(WORKER_IDENTITIES[name], message)
        self._log.info("SIGHUP: configuration reloaded", log_level=new.log_level, log_format=new.log_format,
                       applied=applied, needs_restart=[name for name in changed if name not in RELOADABLE])

    # ------------------------------------------------------------ drain

    def _on_drain_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.lifecycle.state == State.DRAINING:
            self._log.warning("second signal while draining: killing workers now", signal=name)
            self._kill_pair(grace_s=0.0)
            self._finish_drain(forced=True)
            return
        if not self.lifecycle.drain():
            return
        self._log.info("draining", signal=name, drain_timeout_s=self.config.drain_timeout_s)
        self.notifier.stopping(self._status_text())
        self._send_info()
        context = self.workers.get("context")
        if not any(w.alive for w in self.workers.values()):
            self._finish_drain(forced=False)
        elif context is not None and context.alive and context.serving and self._router.send_to(
            WORKER_IDENTITIES["context"], Drain(timeout_s=self.config.drain_timeout_s)
        ):
            self._timers.drain_deadline = time.monotonic() + self.config.drain_timeout_s + self.drain_grace_s
        else:
            # The context generator is still starting: it has no requests to finish.
            self._log.info("context generator not serving yet; stopping workers")
            self._kill_pair()
            self._finish_drain(forced=False)

    def _finish_drain(self, *, forced: bool) -> None:
        if self.gateway is not None:  # served the drained requests' last bytes; now it goes
            self.gateway.stop(grace_s=PARTNER_GRACE_S)
        self.lifecycle.stopped()
        self._exit_code = EXIT_FAILURE if forced else EXIT_OK
        self._done = True
        self._log.info("stopped", forced=forced, uptime_s=round(time.monotonic() - self._started_mono, 3))
        self._notify_status()

    # ------------------------------------------------------------ reporting

    def _pids(self) -> dict[str, int]:
        return {name: w.process.pid for name, w in self.workers.items() if w.alive and w.process.pid}

    def _status_text(self) -> str:
        return self.lifecycle.status_text(pids=self._pids(), endpoint=self.config.client_endpoint)

    def _notify_status(self) -> None:
        self.notifier.status(self._status_text())

    def info(self) -> SupervisorInfo:
        pids = self._pids()
        workers = {name: WorkerInfo(pid=pids.get(name, 0), restarts=self.lifecycle.restarts) for name in WORKER_NAMES}
        if self.gateway is not None:
            workers[supervised_gateway.NAME] = self.gateway.info()
        return SupervisorInfo(info=SupervisorStatus(
            state=self.lifecycle.state,
            uptime_s=time.monotonic() - self._started_mono,
            started_at=self.started_at,
            workers=workers,
            last_failure=self.lifecycle.last_failure[:MAX_FAILURE_CHARS],
            cuda_mps=self._mps_status[:MAX_FAILURE_CHARS],
        ))

    def status(self) -> dict[str, Any]:
        """What the supervisor knows, for the fallback endpoint's `status_reply` (SPEC §3.2)."""
        now = time.monotonic()
        pids = self._pids()
        phases = {}
        for name in WORKER_NAMES:
            worker = self.workers.get(name)
            message = self.lifecycle.phases.get(name)
            since = self.lifecycle.phase_started.get(name, worker.spawned_at if worker else now)
            phases[name] = {
                "phase": message.phase if message else ("starting" if worker else "stopped"),
                "detail": message.detail if message else "",
                "done": message.done if message else 0,
                "total": message.total if message else 0,
                "elapsed_s": round(now - since, 3),
            }
        return {
            "state": self.lifecycle.state.value,
            "source": "supervisor",
            "summary": self._status_text(),
            "version": __version__,
            "uptime_s": now - self._started_mono,
            "started_at": self.started_at,
            "model": self.config.model,
            "endpoints": {"ipc": self.config.client_endpoint, "tcp": self.config.tcp_endpoint or None},
            "workers": {name: worker.to_wire() for name, worker in self.info().info.workers.items()},
            "phases": phases,
            "restarts": self.lifecycle.restarts,
            "last_restart_reason": self.lifecycle.last_failure or None,
            "cuda_mps": self._mps_status or None,
        }

    def _unavailable_text(self) -> str:
        if self.lifecycle.state == State.READY:
            return (f"the daemon was ready, but its client endpoint {self.config.client_endpoint} did not answer; "
                    "retry")
        return f"the daemon is not serving: {self._status_text()}"

    def _send_info(self) -> None:
        self._timers.next_info = time.monotonic() + INFO_INTERVAL_S
        context = self.workers.get("context")
        if self._router is None or context is None or not context.alive or context.last_message is None:
            return
        self._router.send_to(WORKER_IDENTITIES["context"], self.info())

    # ------------------------------------------------------------ teardown

    def _shutdown(self) -> None:
        try:
            if self.workers:
                self._kill_pair(grace_s=0.0)
            if self.gateway is not None:
                self.gateway.stop(grace_s=0.0)
            if self._router is not None:
                self._router.close()
                self._router = None
            if self._fallback is not None:
                self._fallback.close()
                self._fallback = None
        finally:
            self._stop_mps()
            self._restore_signals()
            self._pid_file.release()
            self.notifier.close()


def run_supervisor(config: Config, **options: Any) -> int:
    """`hybridd start`: run in the foreground until drained; returns the exit code.

    Raises AlreadyRunningError before anything is spawned when the runtime
    directory or the endpoint is taken.
    """
    configure_logging(level=config.log_level, json=config.log_format == "json")
    set_process_title("hybridd: supervisor")
    return Supervisor(config, **options).run()
