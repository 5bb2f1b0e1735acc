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

import contextlib
import signal
from collections.abc import Iterator
from typing import Any


class Terminated(SystemExit):
    """A worker's handler of a stop signal raises it: exit code 0, the signal named."""

    def __init__(self, signum: int) -> None:
        super().__init__(0)
        self.signum = signum

    def __str__(self) -> str:
        return f"received {signal.Signals(self.signum).name}"


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
