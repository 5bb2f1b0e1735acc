"""Messages between the supervisor and its two workers (internal, same framing as client messages).

Each worker connects a DEALER to the supervisor's ROUTER (`ipc://{runtime_dir}/supervisor.sock`)
with routing identity `b"graph"` or `b"context"` and reports `worker_phase` and
`heartbeat`. The supervisor sends the context generator `drain` (SIGTERM) and
`supervisor_info` (what the context generator merges into its `status` replies), and
both workers `reconfigure` (SIGHUP reloaded the log level and format).
The lifecycle states, which are also wire values (`health_reply.state`,
`status_reply.status.state`), are defined here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from hybridd.protocol.codec import decode
from hybridd.protocol.envelope import envelope as _envelope
from hybridd.protocol.envelope import check_version, message_type
from hybridd.protocol.envelope import open_envelope as _open
from hybridd.protocol.fields import FieldReader
from hybridd.protocol.limits import MAX_TIMEOUT_S

WORKER_NAMES: tuple[str, ...] = ("graph", "context")
WORKER_IDENTITIES: dict[str, bytes] = {name: name.encode() for name in WORKER_NAMES}
# What `supervisor_info.workers` may list: the pair, and the HTTP gateway when it runs.
SUPERVISED_NAMES: tuple[str, ...] = (*WORKER_NAMES, "gateway")
WORKER_PHASES: frozenset[str] = frozenset({"loading", "capturing", "ready", "draining", "stopped", "failed"})
MAX_PHASE_DETAIL_CHARS = 512
MAX_FAILURE_CHARS = 4096
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS: tuple[str, ...] = ("console", "json")
MAX_WORK_COUNT = 2**63 - 1
MAX_PID = 2**31 - 1


class LifecycleState(StrEnum):
    """The daemon's lifecycle; `hybridd.lifecycle` owns the transitions."""

    STARTING = "starting"
    LOADING = "loading"
    CAPTURING = "capturing"
    READY = "ready"
    DEGRADED = "degraded"  # a worker died; the pair is being restarted
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"  # restarts exhausted; the supervisor exits non-zero


LIFECYCLE_STATES: frozenset[str] = frozenset(s.value for s in LifecycleState)


# ---------------------------------------------------------------- worker → supervisor


@dataclass(slots=True, kw_only=True)
class WorkerPhase:
    """A worker entered `phase`; `done`/`total` count progress inside it (e.g. captured buckets)."""

    TYPE: ClassVar[str] = "worker_phase"

    worker: str
    phase: str
    detail: str = ""
    done: int = 0
    total: int = 0

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE) | {
            "worker": self.worker,
            "phase": self.phase,
            "detail": self.detail,
            "done": self.done,
            "total": self.total,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> WorkerPhase:
        r = _open(data)
        message = cls(
            worker=r.string("worker", choices=frozenset(WORKER_NAMES)),
            phase=r.string("phase", choices=WORKER_PHASES),
            detail=r.string("detail", "", max_chars=MAX_PHASE_DETAIL_CHARS),
            done=r.integer("done", 0, lo=0, hi=MAX_WORK_COUNT),
            total=r.integer("total", 0, lo=0, hi=MAX_WORK_COUNT),
        )
        r.finish()
        return message


@dataclass(slots=True, kw_only=True)
class Heartbeat:
    """A worker's loop is alive; `steps` is its monotonically increasing work counter."""

    TYPE: ClassVar[str] = "heartbeat"

    worker: str
    steps: int

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE) | {"worker": self.worker, "steps": self.steps}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Heartbeat:
        r = _open(data)
        message = cls(
            worker=r.string("worker", choices=frozenset(WORKER_NAMES)),
            steps=r.integer("steps", lo=0, hi=MAX_WORK_COUNT),
        )
        r.finish()
        return message


# ---------------------------------------------------------------- supervisor → context generator


@dataclass(slots=True, kw_only=True)
class Drain:
    """Refuse new requests with `draining`, finish running ones within `timeout_s`, cancel
    the rest, tell the graph generator to shut down, report `stopped`, exit 0."""

    TYPE: ClassVar[str] = "drain"

    timeout_s: float

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE) | {"timeout_s": self.timeout_s}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Drain:
        r = _open(data)
        message = cls(timeout_s=r.number("timeout_s", lo=0.0, hi=MAX_TIMEOUT_S))
        r.finish()
        return message


@dataclass(slots=True, kw_only=True)
class WorkerInfo:
    pid: int
    restarts: int

    def to_wire(self) -> dict[str, Any]:
        return {"pid": self.pid, "restarts": self.restarts}

    @classmethod
    def read(cls, r: FieldReader) -> WorkerInfo:
        info = cls(pid=r.integer("pid", lo=0, hi=MAX_PID), restarts=r.integer("restarts", lo=0, hi=MAX_WORK_COUNT))
        r.finish()
        return info


@dataclass(slots=True, kw_only=True)
class SupervisorInfo:
    """What only the supervisor knows, for the context generator's `status` replies.

    Sent on every lifecycle change and every few seconds; the wire form nests the
    fields under `info` so that the context generator can merge the map as it is.
    """

    TYPE: ClassVar[str] = "supervisor_info"

    state: LifecycleState
    uptime_s: float
    started_at: float  # Unix time the supervisor started
    workers: dict[str, WorkerInfo] = field(default_factory=dict)
    last_failure: str = ""  # why the pair was last restarted ("" before any restart)

    def info(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "uptime_s": self.uptime_s,
            "started_at": self.started_at,
            "workers": {name: worker.to_wire() for name, worker in self.workers.items()},
            "last_failure": self.last_failure,
        }

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE) | {"info": self.info()}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SupervisorInfo:
        r = _open(data)
        info = r.nested("info")
        workers_reader = info.nested("workers")
        names = workers_reader.keys()
        for name in names:
            if name not in SUPERVISED_NAMES:
                workers_reader.string(name, choices=frozenset(SUPERVISED_NAMES))  # raises, naming the path
        message = cls(
            state=LifecycleState(info.string("state", choices=LIFECYCLE_STATES)),
            uptime_s=info.number("uptime_s", lo=0.0),
            started_at=info.number("started_at", lo=0.0),
            workers={name: WorkerInfo.read(workers_reader.nested(name)) for name in names},
            last_failure=info.string("last_failure", "", max_chars=MAX_FAILURE_CHARS),
        )
        workers_reader.finish()
        info.finish()
        r.finish()
        return message


@dataclass(slots=True, kw_only=True)
class Reconfigure:
    """SIGHUP reloaded the settings that apply without a restart (to both workers)."""

    TYPE: ClassVar[str] = "reconfigure"

    log_level: str
    log_format: str

    def to_wire(self) -> dict[str, Any]:
        return _envelope(self.TYPE) | {"log_level": self.log_level, "log_format": self.log_format}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Reconfigure:
        r = _open(data)
        message = cls(log_level=r.string("log_level", choices=frozenset(LOG_LEVELS)),
                      log_format=r.string("log_format", choices=frozenset(LOG_FORMATS)))
        r.finish()
        return message


SupervisorMessage = WorkerPhase | Heartbeat | Drain | SupervisorInfo | Reconfigure
SUPERVISOR_TYPES: dict[str, type[SupervisorMessage]] = {
    cls.TYPE: cls for cls in (WorkerPhase, Heartbeat, Drain, SupervisorInfo, Reconfigure)
}


def supervisor_from_wire(data: Mapping[str, Any]) -> SupervisorMessage:
    check_version(data)
    return SUPERVISOR_TYPES[message_type(data, SUPERVISOR_TYPES)].from_wire(data)


def parse_supervisor(frame: bytes | memoryview) -> SupervisorMessage:
    return supervisor_from_wire(decode(frame))
