"""A worker's link to the supervisor: lifecycle phases and heartbeats out, commands in.

Both workers connect a DEALER (identity = the worker's name) to the supervisor's
ROUTER. Sends never block: with no supervisor listening (a worker pair started by a
test or a benchmark directly) the messages are dropped, and the worker runs the same.

Two sources of heartbeats, for two kinds of liveness. While a worker starts up
(`starting_up()`), a background thread beats: loading weights, compiling or capturing
are single long calls, and the supervisor judges start-up by its own deadline
(`startup_timeout_s`) and the phases reported, not by the loop. Once the worker
serves, only its serving loop beats (`heartbeat()`), so that a stuck loop (a deadlock,
SIGSTOP) falls silent and is caught within `heartbeat_timeout_s`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import zmq

from hybridd.protocol import codec
from hybridd.protocol.errors import ProtocolError
from hybridd.log import configure as configure_logging
from hybridd.protocol.supervisor import (
    MAX_PHASE_DETAIL_CHARS,
    Heartbeat,
    Reconfigure,
    SupervisorCommand,
    WorkerPhase,
)
from hybridd.workers import startup_errors


class SupervisorLink:
    def __init__(self, endpoint: str, worker: str, heartbeat_interval_s: float, context: zmq.Context | None = None):
        self.worker = worker
        self.heartbeat_interval_s = heartbeat_interval_s
        self._socket = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, worker.encode())
        self._socket.setsockopt(zmq.LINGER, 200)
        self._socket.setsockopt(zmq.SNDHWM, 64)
        self._socket.connect(endpoint)
        # The start-up thread and the main thread share the socket; ZeroMQ sockets may
        # change threads only across a full memory barrier, which the lock provides.
        self._lock = threading.Lock()
        self._last_beat = 0.0
        self._parent = os.getppid()
        self.steps = 0
        self.dropped = 0

    @property
    def socket(self) -> zmq.Socket:
        return self._socket

    def _send(self, message: WorkerPhase | Heartbeat) -> None:
        if isinstance(message, Heartbeat) and os.getppid() != self._parent:
            # Orphaned: the supervisor died (SIGKILL) and PR_SET_PDEATHSIG did not reach
            # us. Nobody will ever read our replies; free the GPU and the sockets now.
            os._exit(1)
        with self._lock:
            try:
                self._socket.send(codec.encode(message), zmq.NOBLOCK)
            except zmq.Again:
                pass

    def phase(self, phase: str, detail: str = "", done: int = 0, total: int = 0) -> None:
        self._send(WorkerPhase(worker=self.worker, phase=phase, detail=detail[:MAX_PHASE_DETAIL_CHARS], done=done, total=total))

    def failed(self, reason: str) -> None:
        """A start-up error that no restart can fix (the supervisor exits instead of retrying)."""
        self.phase("failed", reason)

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_beat >= self.heartbeat_interval_s:
            self._last_beat = now
            self._send(Heartbeat(worker=self.worker, steps=self.steps))

    @contextlib.contextmanager
    def starting_up(self) -> Iterator[None]:
        """Heartbeats from a background thread for as long as the block runs; an error
        that no restart can fix (`startup_errors`) is reported as the phase `failed`."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.heartbeat_interval_s):
                self._send(Heartbeat(worker=self.worker, steps=self.steps))

        thread = threading.Thread(target=beat, name=f"{self.worker}-startup-heartbeat", daemon=True)
        self._send(Heartbeat(worker=self.worker, steps=self.steps))
        thread.start()
        try:
            yield
        except Exception as error:
            if startup_errors.is_permanent(error):
                self.failed(startup_errors.describe(self.worker, error))
            raise
        finally:
            stop.set()
            thread.join()

    def poll_command(self) -> SupervisorCommand | None:
        """The next command from the supervisor, if one is waiting (malformed ones are dropped,
        `reconfigure` is applied here)."""
        while True:
            try:
                with self._lock:
                    frame = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            try:
                command = codec.SUPERVISOR_COMMANDS.decode(frame)
            except ProtocolError:
                self.dropped += 1
                continue
            if isinstance(command, Reconfigure):
                configure_logging(level=command.log_level, json=command.log_format == "json")
                continue
            return command

    def close(self) -> None:
        self._socket.close()
