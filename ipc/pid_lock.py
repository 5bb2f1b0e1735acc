"""Pid lock files: a file holding its owner's pid under an exclusive `flock`.

The lock, not the pid, proves liveness: it dies with the process, so a stale file never
blocks a new owner and a reused pid never looks alive. The supervisor's pid file and
the lock beside each bound `ipc://` endpoint are both pid lock files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class LockHeldError(RuntimeError):
    """Another live process holds the lock; `holder` is the pid it wrote ("unknown" if none)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by pid {holder}")
        self.path = path
        self.holder = holder


def acquire(path: Path) -> int:
    """Lock `path` (created 0640 if missing) and write our pid into it; returns the open
    file descriptor, which holds the lock until it is closed (or `release`d)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LockHeldError(path, holder) from None
        # The previous owner may have unlinked the file between our open and our lock:
        # then we hold a lock on a name nobody sees. Retry on the new file.
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release(path: Path, fd: int) -> None:
    """Remove the file (unless a newer owner's file took its name) and drop the lock."""
    with contextlib.suppress(FileNotFoundError):
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    os.close(fd)


def holder(path: Path) -> int | None:
    """The pid of the live process that holds `path`, or None when nothing holds it
    (0 when a holder is alive but wrote no pid)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
