"""The lifecycle state machine and the supervisor↔worker messages, without processes."""

from __future__ import annotations

import pytest

from hybridd.lifecycle import MAX_BACKOFF_S, Lifecycle, LifecycleError, State
from hybridd.protocol import codec, limits
from hybridd.protocol.codec import encode
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.supervisor import (
    Drain,
    Heartbeat,
    LifecycleState,
    SupervisorInfo,
    WorkerInfo,
    SupervisorStatus,
    WorkerPhase,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _phase(worker: str, phase: str, **kw) -> WorkerPhase:
    return WorkerPhase(worker=worker, phase=phase, **kw)


def test_start_to_ready_follows_the_workers():
    life = Lifecycle(max_restarts=3, restart_backoff_s=1.0)
    life.pair_started()
    assert life.state == State.STARTING
    assert life.phase(_phase("context", "loading", detail="loading tokenizer"))
    assert life.state == State.LOADING
    assert life.phase(_phase("graph", "capturing", detail="capturing decode graphs", done=5, total=9))
    assert life.state == State.CAPTURING
    assert "graph: capturing decode graphs 5/9" in life.status_text()
    assert not life.phase(_phase("graph", "ready"))
    assert life.state == State.CAPTURING  # never back to loading
    assert life.phase(_phase("context", "ready"))
    assert life.state == State.READY and life.accepting
    assert life.status_text(pids={"graph": 1, "context": 2}, endpoint="ipc:///x") == (
        "ready: serving ipc:///x; graph pid 1, context pid 2; restarts 0")


def test_failures_back_off_exponentially_up_to_the_ceiling_then_die():
    clock = Clock()
    life = Lifecycle(max_restarts=8, restart_backoff_s=1.0, clock=clock)
    backoffs = []
    for _ in range(8):
        failure = life.failed("graph generator was killed by SIGKILL")
        assert life.state == State.DEGRADED and not life.restart_due()
        clock.now += failure.backoff_s
        assert life.restart_due()
        life.pair_started()
        backoffs.append(failure.backoff_s)
    assert backoffs == [1, 2, 4, 8, 16, 32, MAX_BACKOFF_S, MAX_BACKOFF_S]
    assert life.restarts == 8
    life.failed("again")
    assert life.state == State.DEAD
    assert life.status_text() == "dead: again; 8 restart(s) exhausted"


def test_degraded_stays_until_the_restarted_pair_is_ready_and_stability_clears_the_streak():
    clock = Clock()
    life = Lifecycle(max_restarts=1, restart_backoff_s=0.5, stable_after_s=10, clock=clock)
    life.failed("context generator exited with code 1")
    clock.now += 1
    life.pair_started()
    life.phase(_phase("graph", "capturing", done=1, total=2))
    assert life.state == State.DEGRADED
    assert life.status_text().startswith("degraded: restarting (1/1): graph: capturing 1/2")
    life.phase(_phase("graph", "ready"))
    life.phase(_phase("context", "ready"))
    assert life.state == State.READY
    clock.now += 9
    life.tick()
    assert life.failure_streak == 1
    clock.now += 1
    life.tick()
    assert life.failure_streak == 0
    life.failed("once more")
    assert life.state == State.DEGRADED  # the budget was refilled


def test_drain_is_terminal_and_illegal_moves_raise():
    life = Lifecycle(max_restarts=0, restart_backoff_s=1)
    assert life.drain()
    assert not life.drain()
    assert life.state == State.DRAINING
    life.phase(_phase("context", "stopped"))
    assert life.state == State.DRAINING
    life.stopped()
    assert life.state == State.STOPPED
    with pytest.raises(LifecycleError):
        life.failed("late")
    dead = Lifecycle(max_restarts=0, restart_backoff_s=1)
    dead.failed("boom")
    assert dead.state == State.DEAD
    assert not dead.drain()


@pytest.mark.parametrize(
    "message",
    [
        WorkerPhase(worker="graph", phase="capturing", detail="capturing decode graphs", done=5, total=9),
        Heartbeat(worker="context", steps=12345),
        Drain(timeout_s=30.0),
        SupervisorInfo(info=SupervisorStatus(
            state=LifecycleState.READY, uptime_s=1.5, started_at=1.7e9, last_failure="graph generator hung",
            workers={"graph": WorkerInfo(pid=10, restarts=1), "context": WorkerInfo(pid=11, restarts=1),
                     "gateway": WorkerInfo(pid=12, restarts=0)},
        )),
    ],
)
def test_messages_round_trip(message):
    decoder = codec.WORKER_REPORTS if isinstance(message, WorkerPhase | Heartbeat) else codec.SUPERVISOR_COMMANDS
    assert decoder.decode(encode(message)) == message


def test_each_side_accepts_only_its_peers_messages():
    for decoder, message in [(codec.WORKER_REPORTS, Drain(timeout_s=1.0)),
                             (codec.SUPERVISOR_COMMANDS, Heartbeat(worker="graph", steps=1))]:
        with pytest.raises(ProtocolError) as caught:
            decoder.decode(encode(message))
        assert (caught.value.code, caught.value.field) == (ErrorCode.INVALID_REQUEST, "type")


@pytest.mark.parametrize(
    ("data", "code", "field"),
    [
        ({"v": 1, "type": "worker_phase", "worker": "gpu", "phase": "ready"}, ErrorCode.INVALID_REQUEST, "worker"),
        ({"v": 1, "type": "worker_phase", "worker": "graph", "phase": "napping"}, ErrorCode.INVALID_REQUEST, "phase"),
        ({"v": 1, "type": "worker_phase", "worker": "graph", "phase": "ready", "detail": "x" * 513},
         ErrorCode.TOO_LARGE, "detail"),
        ({"v": 1, "type": "heartbeat", "worker": "graph", "steps": -1}, ErrorCode.INVALID_REQUEST, "steps"),
        ({"v": 1, "type": "heartbeat", "worker": "graph", "steps": 1, "extra": 1}, ErrorCode.INVALID_REQUEST, "extra"),
        ({"v": 1, "type": "drain", "timeout_s": 3601}, ErrorCode.INVALID_REQUEST, "timeout_s"),
        ({"v": limits.PROTOCOL_VERSION + 1, "type": "drain", "timeout_s": 1}, ErrorCode.UNSUPPORTED_VERSION, "v"),
        ({"v": 1, "type": "supervisor_info", "info": {"state": "ready", "uptime_s": 1, "started_at": 1,
                                                      "workers": {"cpu": {"pid": 1, "restarts": 0}}}},
         ErrorCode.INVALID_REQUEST, "info.workers.cpu"),
        ({"v": 1, "type": "supervisor_info", "info": {"state": "sleepy", "uptime_s": 1, "started_at": 1,
                                                      "workers": {}}}, ErrorCode.INVALID_REQUEST, "info.state"),
        ({"v": 1, "type": "generate"}, ErrorCode.INVALID_REQUEST, "type"),
    ],
)
def test_bad_messages_are_refused_naming_the_field(data, code, field):
    with pytest.raises(ProtocolError) as caught:
        decoder = codec.WORKER_REPORTS if data["type"] in ("worker_phase", "heartbeat") else codec.SUPERVISOR_COMMANDS
        decoder.decode(encode(data))
    assert caught.value.code == code
    assert caught.value.field == field


def test_supervisor_deadlines_are_the_configured_settings():
    from hybridd.config import Config, ConfigError
    from hybridd.supervisor import Supervisor

    supervisor = Supervisor(Config(heartbeat_timeout_s=3.0, startup_timeout_s=42.0))
    assert (supervisor.heartbeat_timeout_s, supervisor.startup_timeout_s) == (3.0, 42.0)
    with pytest.raises(ConfigError, match=r"heartbeat_timeout_s \(0.4\) must be at least twice heartbeat_interval_s"):
        Config(heartbeat_interval_s=0.25, heartbeat_timeout_s=0.4).validate()


def test_a_failure_while_ready_with_the_budget_spent_is_dead_not_a_lifecycle_error():
    clock = Clock()
    life = Lifecycle(max_restarts=1, restart_backoff_s=0.1, clock=clock)
    life.pair_started()
    for worker in ("graph", "context"):
        life.phase(_phase(worker, "ready"))
    life.failed("context generator was killed by SIGKILL")
    clock.now += 1
    life.pair_started()
    for worker in ("graph", "context"):
        life.phase(_phase(worker, "ready"))
    assert life.state == State.READY
    life.failed("context generator was killed by SIGKILL")
    assert life.state == State.DEAD
    assert life.status_text().startswith("dead: context generator was killed by SIGKILL")


def test_a_permanent_start_up_error_is_dead_at_once():
    life = Lifecycle(max_restarts=5, restart_backoff_s=1.0)
    life.pair_started()
    life.phase(_phase("graph", "loading", detail="loading weights"))
    life.fatal("graph generator: /m/model.safetensors: truncated")
    assert life.state == State.DEAD and not life.restart_pending
