"""Futex waits and wakes on a 32-bit word of memory shared between processes.

A thread sleeps in the kernel until another process (or thread) that maps the same
word wakes it, with no thread in between: the reply ring's reader sleeps on the
daemon's write position this way (ipc/reply_ring.py). Linux on x86-64 only, like the
ring; the calls go through libc's `syscall`.
"""

from __future__ import annotations

import ctypes
import errno
import threading

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wait(word: ctypes.c_uint32, expected: int, timeout_s: float) -> None:
    """Sleep while `word` holds `expected`, until a wake, for at most `timeout_s` (a
    signal or a spurious wake-up may return sooner: callers check what they wait for)."""
    whole = int(timeout_s)
    timeout = _Timespec(whole, int((timeout_s - whole) * 1e9))
    result = _syscall(_SYS_FUTEX, ctypes.c_void_p(ctypes.addressof(word)), _FUTEX_WAIT,
                      ctypes.c_uint32(expected), ctypes.byref(timeout), None, 0)
    if result == -1:
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(code, f"futex wait: {errno.errorcode.get(code, code)}")


def wake(word: ctypes.c_uint32) -> None:
    """Wake every thread, in any process, sleeping on `word`."""
    _syscall(_SYS_FUTEX, ctypes.c_void_p(ctypes.addressof(word)), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)


_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier: a store before it is visible to every core before a load
    after it reads. An uncontended lock's acquire is a locked instruction on x86-64, the
    barrier Python has no other spelling for."""
    with _fence_lock:
        pass
