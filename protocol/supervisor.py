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

import typing
from enum import StrEnum
from typing import Annotated, Literal

from msgspec import Meta

from hybridd.protocol.envelope import Fields, Message, Seconds
from hybridd.protocol.limits import MAX_TIMEOUT_S

WorkerName = Literal["graph", "context"]
WORKER_NAMES: tuple[WorkerName, ...] = ("graph", "context")
WORKER_IDENTITIES: dict[str, bytes] = {name: name.encode() for name in WORKER_NAMES}
# What `supervisor_info.workers` may list: the pair, and the HTTP gateway when it runs.
SupervisedName = Literal["graph", "context", "gateway"]
SUPERVISED_NAMES: tuple[SupervisedName, ...] = typing.get_args(SupervisedName)
WorkerPhaseName = Literal["loading", "capturing", "ready", "draining", "stopped", "failed"]
MAX_PHASE_DETAIL_CHARS = 512
MAX_FAILURE_CHARS = 4096
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LOG_LEVELS: tuple[LogLevel, ...] = typing.get_args(LogLevel)
LogFormat = Literal["console", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = typing.get_args(LogFormat)
MAX_WORK_COUNT = 2**63 - 1
MAX_PID = 2**31 - 1
WorkCount = Annotated[int, Meta(ge=0, le=MAX_WORK_COUNT)]


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


# ---------------------------------------------------------------- worker → supervisor


class WorkerPhase(Message, tag="worker_phase"):
    """A worker entered `phase`; `done`/`total` count progress inside it (e.g. captured buckets)."""

    worker: WorkerName
    phase: WorkerPhaseName
    detail: Annotated[str, Meta(max_length=MAX_PHASE_DETAIL_CHARS)] = ""
    done: WorkCount = 0
    total: WorkCount = 0


class Heartbeat(Message, tag="heartbeat"):
    """A worker's loop is alive; `steps` is its monotonically increasing work counter."""

    worker: WorkerName
    steps: WorkCount


WorkerReport = WorkerPhase | Heartbeat


# ---------------------------------------------------------------- supervisor → workers


class Drain(Message, tag="drain"):
    """Refuse new requests with `draining`, finish running ones within `timeout_s`, cancel
    the rest, tell the graph generator to shut down, report `stopped`, exit 0."""

    timeout_s: Annotated[float, Meta(ge=0.0, le=MAX_TIMEOUT_S)]


class WorkerInfo(Fields):
    pid: Annotated[int, Meta(ge=0, le=MAX_PID)]
    restarts: WorkCount


class SupervisorStatus(Fields):
    """What only the supervisor knows; the context generator merges it into `status` as it is."""

    state: LifecycleState
    uptime_s: Seconds
    started_at: Seconds  # Unix time the supervisor started
    workers: dict[SupervisedName, WorkerInfo] = {}
    last_failure: Annotated[str, Meta(max_length=MAX_FAILURE_CHARS)] = ""  # why the pair was last restarted
    cuda_mps: Annotated[str, Meta(max_length=MAX_FAILURE_CHARS)] = ""  # whether the workers share the GPU through MPS


class SupervisorInfo(Message, tag="supervisor_info"):
    """Sent on every lifecycle change and every few seconds."""

    info: SupervisorStatus


class Reconfigure(Message, tag="reconfigure"):
    """SIGHUP reloaded the settings that apply without a restart (to both workers)."""

    log_level: LogLevel
    log_format: LogFormat


SupervisorCommand = Drain | SupervisorInfo | Reconfigure
