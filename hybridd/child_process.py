"""A spawned child's ties to the process that started it: it dies with that process and
names itself for ps and top."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> bool:
    """Be killed when the parent dies (Linux's parent-death signal), so that a parent
    SIGKILLed leaves no child holding the GPU, a socket or memory. False when the parent
    `parent_pid` died before the signal was asked for: the caller then exits."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the parent's own clean-up ends it
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return os.getppid() == parent_pid


def set_process_title(title: str) -> None:
    """`hybridd: supervisor` etc. in ps/top instead of `python3 -c from multiprocessing…`."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # the title is cosmetic; setproctitle comes with the server extra
        return
    setproctitle(title)
