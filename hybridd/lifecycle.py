"""The daemon's lifecycle state machine: which state it is in, how it gets to the next one,
the restart budget, and the one-line status systemd shows.

`starting → loading → capturing → ready → draining → stopped`, plus `degraded` from a
worker's death until the restarted pair is ready again, and `dead` when the restart
budget is spent. The state is derived from the phases the two workers report; the
supervisor feeds events in and acts on what comes out. No I/O happens here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hybridd.protocol.supervisor import WORKER_NAMES, LifecycleState, WorkerPhase

State = LifecycleState

# Exponential backoff doubles from `restart_backoff_s` up to this ceiling.
MAX_BACKOFF_S = 60.0
# A pair that has served this long without dying wipes the failure streak, so that a
# rare crash a week apart does not eat into `max_restarts` forever.
STABLE_AFTER_S = 600.0

_ORDER = {State.STARTING: 0, State.LOADING: 1, State.CAPTURING: 2, State.READY: 3}
_ALLOWED: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.LOADING, State.CAPTURING, State.READY, State.DEGRADED, State.DRAINING, State.DEAD}),
    State.LOADING: frozenset({State.CAPTURING, State.READY, State.DEGRADED, State.DRAINING, State.DEAD}),
    State.CAPTURING: frozenset({State.READY, State.DEGRADED, State.DRAINING, State.DEAD}),
    State.READY: frozenset({State.DEGRADED, State.DRAINING, State.DEAD}),
    State.DEGRADED: frozenset({State.READY, State.DEGRADED, State.DRAINING, State.DEAD}),
    State.DRAINING: frozenset({State.STOPPED}),
    State.STOPPED: frozenset(),
    State.DEAD: frozenset(),
}


class LifecycleError(RuntimeError):
    """An event that the state machine does not allow in its current state (a bug)."""


@dataclass(slots=True)
class Failure:
    reason: str
    backoff_s: float  # how long to wait before the next pair; 0 when dead


class Lifecycle:
    def __init__(
        self,
        *,
        max_restarts: int,
        restart_backoff_s: float,
        stable_after_s: float = STABLE_AFTER_S,
        clock=time.monotonic,
    ) -> None:
        self.state = State.STARTING
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self.stable_after_s = stable_after_s
        self.restarts = 0  # pairs started after the first, over the supervisor's life
        self.failure_streak = 0  # deaths since the last stable period; bounded by max_restarts
        self.last_failure = ""
        self.phases: dict[str, WorkerPhase] = {}
        self.phase_started: dict[str, float] = {}  # when each worker entered its current phase
        self._clock = clock
        self._ready_since: float | None = None
        self._restart_at: float | None = None
        self._backoff_s = 0.0

    # ------------------------------------------------------------ events

    def _move(self, new: State) -> bool:
        if new == self.state and new != State.DEGRADED:
            return False
        if new not in _ALLOWED[self.state]:
            raise LifecycleError(f"lifecycle: {self.state.value} → {new.value} is not allowed")
        self.state = new
        self._ready_since = self._clock() if new == State.READY else None
        return True

    def pair_started(self) -> None:
        """A new pair of workers was spawned (the first, or a restart after `failed`)."""
        if self._restart_at is not None:
            self.restarts += 1
        self._restart_at = None
        self.phases = {}
        self.phase_started = {}

    def phase(self, message: WorkerPhase) -> bool:
        """A worker reported a phase; True when the daemon's state changed."""
        previous = self.phases.get(message.worker)
        if previous is None or previous.phase != message.phase:
            self.phase_started[message.worker] = self._clock()
        self.phases[message.worker] = message
        if self.state not in _ORDER and self.state != State.DEGRADED:
            return False  # draining/stopped/dead: worker phases no longer drive the state
        if all(self.phases.get(w) and self.phases[w].phase == "ready" for w in WORKER_NAMES):
            return self._move(State.READY)
        if self.state == State.DEGRADED:
            return False  # stays degraded until the restarted pair is ready
        graph = self.phases.get("graph")
        derived = State.CAPTURING if graph and graph.phase in ("capturing", "ready") else State.LOADING
        if _ORDER[derived] > _ORDER[self.state]:
            return self._move(derived)
        return False

    def failed(self, reason: str) -> Failure:
        """A worker died or stopped heartbeating; decides between a restart and `dead`."""
        self.last_failure = reason
        self.failure_streak += 1
        if self.failure_streak > self.max_restarts:
            self._move(State.DEAD)
            return Failure(reason, 0.0)
        backoff = min(self.restart_backoff_s * 2 ** (self.failure_streak - 1), MAX_BACKOFF_S)
        self._move(State.DEGRADED)
        self._backoff_s = backoff
        self._restart_at = self._clock() + backoff
        return Failure(reason, backoff)

    def fatal(self, reason: str) -> None:
        """A worker found a start-up error that no restart can fix: `dead` at once."""
        self.last_failure = reason
        self._restart_at = None
        if self.state != State.DEAD:
            self._move(State.DEAD)

    def restart_due(self) -> bool:
        return self._restart_at is not None and self._clock() >= self._restart_at

    def tick(self) -> None:
        """Time passes: a pair that stays ready long enough clears the failure streak."""
        if self._ready_since is not None and self.failure_streak and self._clock() - self._ready_since >= self.stable_after_s:
            self.failure_streak = 0

    def drain(self) -> bool:
        """SIGTERM/SIGINT: False when already draining or finished."""
        if self.state in (State.DRAINING, State.STOPPED, State.DEAD):
            return False
        self._restart_at = None
        return self._move(State.DRAINING)

    def stopped(self) -> None:
        self._move(State.STOPPED)

    # ------------------------------------------------------------ views

    @property
    def accepting(self) -> bool:
        return self.state == State.READY

    @property
    def restart_pending(self) -> bool:
        return self._restart_at is not None

    def phase_text(self, worker: str) -> str:
        message = self.phases.get(worker)
        if message is None:
            return f"{worker}: starting"
        text = message.detail or message.phase
        if message.total:
            text = f"{text} {message.done}/{message.total}"
        return f"{worker}: {text}"

    def status_text(self, *, pids: dict[str, int] | None = None, endpoint: str = "") -> str:
        """One line for systemd's STATUS= (and `systemctl status`)."""
        state = self.state
        workers = ", ".join(f"{w} pid {pid}" for w, pid in (pids or {}).items())
        if state == State.READY:
            text = f"ready: serving {endpoint}" if endpoint else "ready"
            return f"{text}; {workers}; restarts {self.restarts}" if workers else text
        if state == State.STARTING:
            return "starting workers"
        if state in (State.LOADING, State.CAPTURING):
            return f"{state.value}: " + "; ".join(self.phase_text(w) for w in WORKER_NAMES)
        if state == State.DEGRADED:
            if self._restart_at is not None:
                return (f"degraded: {self.last_failure}; restart {self.failure_streak}/{self.max_restarts} "
                        f"in {self._backoff_s:g} s")
            return (f"degraded: restarting ({self.failure_streak}/{self.max_restarts}): "
                    + "; ".join(self.phase_text(w) for w in WORKER_NAMES))
        if state == State.DRAINING:
            return "draining: refusing new requests, finishing running ones"
        if state == State.DEAD:
            return f"dead: {self.last_failure}; {self.max_restarts} restart(s) exhausted"
        return "stopped"
