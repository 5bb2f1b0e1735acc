"""POSIX shared memory segments named after their owner's pid, and their reaping.

Segments are created and mapped directly (shm_open + mmap), outside
`multiprocessing.resource_tracker`: workers spawned by one supervisor share one
tracker, so one process unregistering a segment would erase another's registration
and the tracker would then warn, or unlink a segment still in use. Instead the
lifetime is explicit: the owner unlinks the name (as soon as the importer has mapped
it, and at close), and `reap_stale_segments` removes the segments of dead owners.

A mapping outlives its name: views stay valid after unlink, and the memory returns
to the system when the last view of the last process is gone.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from pathlib import Path

import _posixshmem  # the stdlib's own shm_open/shm_unlink, used by multiprocessing.shared_memory

from hybridd.log import get_logger

log = get_logger("hybridd.ipc.posix_shm")

SEGMENT_PREFIX = "hybridd-"
SHM_DIR = Path("/dev/shm")
_SEGMENT_NAME = re.compile(rf"^{re.escape(SEGMENT_PREFIX)}(\d+)-[0-9a-f]+$")


def new_segment_name() -> str:
    return f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def create_segment(name: str, nbytes: int) -> mmap.mmap:
    """Create, size and map a new segment (mode 0600: the workers share one user)."""
    fd = _posixshmem.shm_open(f"/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        # Reserve the pages now: on a full /dev/shm this fails with ENOSPC here
        # instead of a SIGBUS at the first write into a sparse page.
        os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes)
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        os.close(fd)


def open_segment(name: str, nbytes: int) -> mmap.mmap:
    """Map an existing segment, checking that its size is the one announced."""
    fd = _posixshmem.shm_open(f"/{name}", os.O_RDWR, mode=0)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"shared memory segment {name} has {size} bytes, the manifest says {nbytes}")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> bool:
    """Remove the segment's name; False when it was already gone."""
    try:
        _posixshmem.shm_unlink(f"/{name}")
    except FileNotFoundError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (killed, not yet waited for) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:  # reaped since the signal check
        return False
    except OSError:
        return True
    # The state letter follows the parenthesized command name, which may contain spaces.
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def reap_stale_segments() -> list[str]:
    """Unlink every hybridd segment whose owner pid is dead; returns their names.

    The supervisor calls this at start and after a worker dies.
    """
    reaped: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return reaped
    for entry in entries:
        match = _SEGMENT_NAME.match(entry)
        if match and not pid_alive(int(match.group(1))) and unlink_segment(entry):
            reaped.append(entry)
    if reaped:
        log.warning("reaped shared memory of dead processes", segments=reaped)
    return reaped
