"""Why a worker left its serving loop, in its log (workers/loop_exit.py): a command as
info; a signal's exit, any other BaseException or a return nobody asked for as an error."""

from __future__ import annotations

import signal

import pytest

from hybridd.workers.loop_exit import LoopExit, Terminated


class Log:
    """A logger that keeps what it is given (structlog's call shape)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict]] = []

    def error(self, event: str, **fields) -> None:
        self.records.append(("error", event, fields))

    def info(self, event: str, **fields) -> None:
        self.records.append(("info", event, fields))


def test_a_commanded_end_is_info():
    exit_ = LoopExit(Log())
    with exit_.watch():
        exit_.commanded("drain")
    assert exit_.log.records == [("info", "serving loop ended", {"command": "drain"})]


@pytest.mark.parametrize("raised, reason", [
    (Terminated(signal.SIGTERM), "Terminated: received SIGTERM"),
    (KeyboardInterrupt(), "KeyboardInterrupt: "),
    (SystemExit(0), "SystemExit: 0"),
])
def test_a_signal_or_an_exit_is_an_error_naming_it(raised, reason):
    exit_ = LoopExit(Log())
    with pytest.raises(type(raised)), exit_.watch():
        raise raised
    ((level, event, fields),) = exit_.log.records
    assert (level, event, fields["reason"]) == ("error", "left the serving loop without a command", reason)


def test_a_return_nobody_asked_for_is_an_error_and_exceptions_are_left_to_the_process():
    exit_ = LoopExit(Log())
    with exit_.watch():
        pass
    assert exit_.log.records == [("error", "left the serving loop without a command", {"reason": "the loop returned"})]
    with pytest.raises(ValueError), exit_.watch():
        raise ValueError("logged by worker_main, with its traceback")
    assert len(exit_.log.records) == 1
