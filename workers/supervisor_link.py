"""A worker's link to the supervisor: lifecycle phases and heartbeats out, commands in.

Both workers connect a DEALER (identity = the worker's name) to the supervisor's
ROUTER. Sends never block: with no supervisor listening (a worker pair started by a
test or a benchmark directly) the messages are dropped, and the worker runs the same.
"""

from __future__ import annotations

import time
import zmq

from hybridd.protocol import codec
from hybridd.protocol.errors import ProtocolError
from hybridd.protocol.supervisor import MAX_PHASE_DETAIL_CHARS, Heartbeat, SupervisorMessage, WorkerPhase, parse_supervisor


class SupervisorLink:
    def __init__(self, endpoint: str, worker: str, heartbeat_interval_s: float, context: zmq.Context | None = None):
        self.worker = worker
        self.heartbeat_interval_s = heartbeat_interval_s
        self._socket = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, worker.encode())
        self._socket.setsockopt(zmq.LINGER, 200)
        self._socket.setsockopt(zmq.SNDHWM, 64)
        self._socket.connect(endpoint)
        self._last_beat = 0.0
        self.steps = 0
        self.dropped = 0

    @property
    def socket(self) -> zmq.Socket:
        return self._socket

    def _send(self, message: WorkerPhase | Heartbeat) -> None:
        try:
            self._socket.send(codec.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def phase(self, phase: str, detail: str = "", done: int = 0, total: int = 0) -> None:
        self._send(WorkerPhase(worker=self.worker, phase=phase, detail=detail[:MAX_PHASE_DETAIL_CHARS], done=done, total=total))

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_beat >= self.heartbeat_interval_s:
            self._last_beat = now
            self._send(Heartbeat(worker=self.worker, steps=self.steps))

    def poll_command(self) -> SupervisorMessage | None:
        """The next command from the supervisor, if one is waiting (malformed ones are dropped)."""
        while True:
            try:
                frame = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            try:
                return parse_supervisor(frame)
            except ProtocolError:
                self.dropped += 1

    def close(self) -> None:
        self._socket.close()
