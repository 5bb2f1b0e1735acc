"""Why a worker left its serving loop, in its log.

A command ends a serving loop (the supervisor's drain, the context generator's
shutdown of the graph generator): the loop names it (`commanded`) and it is logged as
info. Anything else ends it too — a signal, an exception of any kind, a return that no
command asked for — and is logged as an error naming it, so that no restart of the pair
is ever without its reason in the log. Exceptions (`Exception`) are logged where the
process ends (`hybridd.supervisor.worker_main`, the context generator's `engine_dead`);
this logs what they do not: SystemExit (a signal's handler), KeyboardInterrupt,
GeneratorExit and plain returns.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any


class Terminated(SystemExit):
    """A worker's handler of a stop signal raises it: exit code 0, the signal named."""

    def __init__(self, signum: int) -> None:
        super().__init__(0)
        self.signum = signum

    def __str__(self) -> str:
        return f"received {signal.Signals(self.signum).name}"


def stop_signals_from(parent: int, log: Any) -> None:
    """Let SIGTERM stop this worker only when `parent` (the supervisor) sends it.

    The supervisor stops a worker whose partner failed with SIGTERM (time to answer its
    clients) and decides what a signal to the whole process group means (a drain, told
    by a message). A SIGTERM from any other process is logged as an error naming the
    sender, and ignored. The signal must be blocked in every thread but the watcher's,
    which takes it with its sender (`sigwaitinfo`) and raises the main thread's handler
    for the supervisor's: a worker blocks it before any of its threads starts (each
    inherits the mask; `hybridd.supervisor.worker_main`), and this blocks it too."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def watch() -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == parent:
                _thread.interrupt_main(signal.SIGTERM)
                return
            log.error("SIGTERM ignored: only the supervisor stops a worker", sender_pid=info.si_pid,
                      supervisor_pid=parent, pid=os.getpid())

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()


class LoopExit:
    def __init__(self, log: Any) -> None:
        self.log = log
        self.command: str | None = None

    def commanded(self, command: str) -> None:
        """The loop ends because `command` asked it to (logged as info)."""
        self.command = command

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Around the serving loop: log why it was left."""
        try:
            yield
        except Exception:
            raise  # logged where the process ends, with its traceback
        except BaseException as exc:
            self.log.error("left the serving loop without a command", reason=f"{type(exc).__name__}: {exc}",
                           exc_info=not isinstance(exc, Terminated))
            raise
        if self.command is None:
            self.log.error("left the serving loop without a command", reason="the loop returned")
        else:
            self.log.info("serving loop ended", command=self.command)
