"""A worker's life from start-up to the end of its serving loop, the same for both workers.

Its start-up runs under the supervisor link's heartbeats (`SupervisorLink.starting_up`,
which reports an error no restart can fix); the objects start-up made are then frozen out
of the cyclic collector's reach (`gc_pauses.freeze_start_up`); its serving loop runs
under `LoopExit.watch`, which logs why it was left. What each worker does before (its
signals) and after (its clean-up, its clients' replies) stays in its own `main`.
"""

from __future__ import annotations

from typing import Any, Protocol

from hybridd.runtime import gc_pauses
from hybridd.workers.loop_exit import LoopExit
from hybridd.workers.supervisor_link import SupervisorLink


class Worker(Protocol):
    link: SupervisorLink
    loop_exit: LoopExit
    log: Any

    def start(self) -> None: ...

    def serve(self) -> None: ...


def start_and_serve(worker: Worker) -> None:
    with worker.link.starting_up():
        worker.start()
    frozen = gc_pauses.freeze_start_up()
    worker.log.debug("start-up objects frozen out of the cyclic collector", objects=frozen)
    with worker.loop_exit.watch():
        worker.serve()
