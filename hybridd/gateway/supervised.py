"""The gateway as a child of the supervisor: spawned with the workers, restarted with
the same bounded exponential backoff when it exits, stopped after the drain.

It lives apart from the worker pair: a gateway restart leaves the engine serving,
and a pair restart leaves the gateway up (its client reconnects; meanwhile it
answers 503). A gateway that keeps dying — `max_restarts` deaths in a row without
a stable period in between — is given up on, and the supervisor exits non-zero so
that the service manager sees the failure. Liveness is its process sentinel.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from multiprocessing.process import BaseProcess

from hybridd.lifecycle import MAX_BACKOFF_S, STABLE_AFTER_S
from hybridd.log import get_logger
from hybridd.protocol.supervisor import WorkerInfo

log = get_logger("supervisor")

NAME = "gateway"


def gateway_process(config: dict[str, Any], supervisor_endpoint: str) -> None:
    """The gateway's entry point as the supervisor spawns it: the ASGI stack is imported
    in the fresh process, so the supervisor stays light."""
    from hybridd.gateway import process

    process.main(config, supervisor_endpoint)


TARGET = gateway_process


class SupervisedGateway:
    def __init__(self, spawn: Callable[[], BaseProcess], *, max_restarts: int, restart_backoff_s: float,
                 stable_after_s: float = STABLE_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._spawn = spawn
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self.stable_after_s = stable_after_s
        self._clock = clock
        self.process: BaseProcess | None = None
        self.restarts = 0
        self.failure_streak = 0
        self.given_up = False
        self._started_at = 0.0
        self._restart_at: float | None = None

    @property
    def sentinel(self) -> int | None:
        return self.process.sentinel if self.process is not None else None

    @property
    def pid(self) -> int:
        return self.process.pid or 0 if self.process is not None else 0

    def start(self) -> None:
        self.process = self._spawn()
        self._started_at = self._clock()
        self._restart_at = None
        log.info("spawned the gateway", pid=self.process.pid, restarts=self.restarts)

    def exited(self) -> None:
        """Its sentinel fired: schedule a restart, or give up when the budget is spent."""
        assert self.process is not None
        self.process.join()
        code = self.process.exitcode
        self.process.close()
        self.process = None
        if self._clock() - self._started_at >= self.stable_after_s:
            self.failure_streak = 0
        self.failure_streak += 1
        if self.failure_streak > self.max_restarts:
            self.given_up = True
            log.error("the gateway keeps exiting; restarts exhausted", exit_code=code, max_restarts=self.max_restarts)
            return
        backoff = min(self.restart_backoff_s * 2 ** (self.failure_streak - 1), MAX_BACKOFF_S)
        self._restart_at = self._clock() + backoff
        log.warning("the gateway exited; restarting", exit_code=code, backoff_s=backoff, streak=self.failure_streak)

    def tick(self) -> None:
        if self._restart_at is not None and self._clock() >= self._restart_at:
            self.restarts += 1
            self.start()

    def stop(self, grace_s: float) -> None:
        """SIGTERM (running responses finish), SIGKILL after `grace_s`; no restart after it."""
        self._restart_at = None
        process, self.process = self.process, None
        if process is None:
            return
        if process.exitcode is None:
            if grace_s > 0:
                process.terminate()
                process.join(grace_s)
            if process.exitcode is None:
                process.kill()
        process.join()
        process.close()

    def info(self) -> WorkerInfo:
        return WorkerInfo(pid=self.pid, restarts=self.restarts)
