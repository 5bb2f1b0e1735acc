"""The reply ring: a same-host client's replies in shared memory, beside its socket.

A client on the daemon's host may create a ring in memory (a memfd) and ask the
daemon to attach it (`attach_ring`, protocol/SPEC.md). From the daemon's
`ring_attached` reply on, the session's replies are numbered 1, 2, ... and each is
written into the ring as well as sent on the socket, ring first. The socket stays
complete: a reply the ring has no room for is simply left out of it. The client takes
each reply from whichever path brings it first and drops the other copy by its number
(a socket reply's number is its place after `ring_attached`). A client thread that
polls the ring sees a reply as soon as the daemon wrote it, without waiting for either
side's ZeroMQ I/O thread to wake up; a thread that sleeps instead is woken by the
daemon itself, through a futex on the ring's bell (ipc/futex.py).

Layout: a header of four 64-byte lines (magic and capacity; the daemon's write
position and the bell; the client's read position and its count of sleepers; spare),
then `capacity` bytes of records. A record is its payload's length (u32), a zero u32,
its number (u64), the payload, and zero padding to 8 bytes; a record that would run
past the end is preceded by the length `WRAP`, and the reader continues at offset 0.
Positions count bytes since the attach and never wrap; a record sits at
`position % capacity`.

Each side publishes its position with one aligned 8-byte store after the bytes it
covers. x86-64 keeps one core's stores in order and its loads in order, so a reader
that sees a position sees the bytes before it; elsewhere the ring is not offered.
After each record the daemon also stores the low 32 bits of its write position in the
bell and, when the client counts a sleeper, wakes the bell's futex; the client flips
the bell's top bit itself (and wakes it) when a reply came by the socket instead. A
sleeper that read the bell before looking for its reply and sleeps while the bell
still holds that value misses neither.

The daemon trusts nothing the client controls. It maps only a memfd sealed against
shrinking (a client that could truncate the memory would crash the daemon's next write
with SIGBUS), opened through `/proc/<pid>/fd/<fd>` of the process at the other end of
the session's socket (its kernel credentials, not a pid the client claims), which the
kernel allows only for the daemon's own user. A read position that is not between the
records it has written and its write position breaks the ring (`RingBroken`).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import socket
import stat
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from hybridd.ipc import futex

MAGIC = 0x3130474E49524448  # "HDRING01", little-endian
HEADER_BYTES = 256
_WRITE_AT = 64
_BELL_AT = 72
_READ_AT = 128
_SLEEPERS_AT = 136
_BELL_FLIP = 0x80000000  # the client's change of the bell: never a value the daemon is about to store
_RECORD = struct.Struct("<IIQ")  # length, zero, number
WRAP = 0xFFFFFFFF


def supported() -> bool:
    """Whether this machine keeps the store and load order the ring relies on."""
    return platform.machine().lower() in ("x86_64", "amd64")


def segment_bytes(capacity: int) -> int:
    return HEADER_BYTES + capacity


def peer_pid(fd: int) -> int:
    """The pid of the process at the other end of the Unix socket `fd` (SO_PEERCRED)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, fileno=fd)
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    finally:
        sock.detach()  # the descriptor is ZeroMQ's
    return pid


def _padded(n: int) -> int:
    return (n + 7) & ~7


class RingBroken(Exception):
    """The client's side of the ring holds a position the daemon did not give it."""


class _Mapping:
    """A mapped ring segment and its header's words: the two positions (aligned 8-byte
    words), the bell and the count of sleepers (aligned 4-byte words)."""

    def __init__(self, name: str, mapping: mmap.mmap, capacity: int) -> None:
        self.name = name
        self.map = mapping
        self.capacity = capacity
        self.write_pos = ctypes.c_uint64.from_buffer(mapping, _WRITE_AT)
        self.read_pos = ctypes.c_uint64.from_buffer(mapping, _READ_AT)
        self.bell = ctypes.c_uint32.from_buffer(mapping, _BELL_AT)
        self.sleepers = ctypes.c_uint32.from_buffer(mapping, _SLEEPERS_AT)

    def close(self) -> None:
        if not hasattr(self, "bell"):
            return  # closed already
        # The ctypes views export the buffer; mmap refuses to close while they live.
        del self.write_pos, self.read_pos, self.bell, self.sleepers
        try:
            self.map.close()
        except BufferError:
            # A frame still holds a view: an exception's traceback through a wait on the
            # bell (Ctrl-C during a futex wait). The memory is unmapped when the last
            # view goes with it; the close must not turn that exception into another.
            pass


class RingWriter:
    """The daemon's end: attaches a client's segment and appends numbered replies."""

    def __init__(self, pid: int, fd: int, nbytes: int) -> None:
        """Map the memfd `fd` of process `pid` (its size must be `nbytes`, sealed against
        shrinking) and check that it is a fresh ring; OSError or ValueError say what is
        wrong with it."""
        name = f"/proc/{pid}/fd/{fd}"
        # Only a memfd is opened: never a device, a FIFO or a file that the open itself
        # could act on or stall.
        target = os.readlink(name)
        if not target.startswith("/memfd:"):
            raise ValueError(f"reply ring {name} is not a memfd (it is {target[:200]!r})")
        handle = os.open(name, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            info = os.fstat(handle)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"reply ring {name} is not a memfd (not a regular file)")
            size = info.st_size
            if size != nbytes:
                raise ValueError(f"reply ring {name} holds {size} bytes, the request says {nbytes}")
            try:
                seals = fcntl.fcntl(handle, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0  # not a memfd
            if not seals & fcntl.F_SEAL_SHRINK:
                raise ValueError(f"reply ring {name} is not a memfd sealed against shrinking (F_SEAL_SHRINK)")
            mapping = mmap.mmap(handle, nbytes)
        finally:
            os.close(handle)
        try:
            magic, capacity = struct.unpack_from("<QQ", mapping, 0)
            if magic != MAGIC:
                raise ValueError(f"{name} is not a reply ring (magic {magic:#x})")
            if capacity != nbytes - HEADER_BYTES:
                raise ValueError(f"reply ring {name} says its capacity is {capacity} bytes, "
                                 f"its segment holds {nbytes - HEADER_BYTES}")
            positions = struct.unpack_from("<Q", mapping, _WRITE_AT)[0], struct.unpack_from("<Q", mapping, _READ_AT)[0]
            if positions != (0, 0):
                raise ValueError(f"reply ring {name} is not fresh (positions {positions})")
        except BaseException:
            mapping.close()
            raise
        self._ring = _Mapping(name, mapping, capacity)
        self._write = 0
        self.number = 0  # of the last reply numbered

    def put(self, frame: bytes) -> bool:
        """Number the next reply and append it; False when the ring has no room for it
        now (the socket carries it alone). Raises RingBroken for a bad read position."""
        self.number += 1
        ring = self._ring
        capacity, write = ring.capacity, self._write
        read = ring.read_pos.value
        if not write - capacity <= read <= write:
            raise RingBroken(f"the client's read position {read} is outside [{max(0, write - capacity)}, {write}]")
        need = _RECORD.size + _padded(len(frame))
        offset = write % capacity
        skip = capacity - offset if offset + need > capacity else 0
        if need > capacity or (write - read) + skip + need > capacity:
            return False
        if skip:
            struct.pack_into("<I", ring.map, HEADER_BYTES + offset, WRAP)
            write += skip
            offset = 0
        at = HEADER_BYTES + offset
        _RECORD.pack_into(ring.map, at, len(frame), 0, self.number)
        ring.map[at + _RECORD.size:at + _RECORD.size + len(frame)] = frame
        write += need
        ring.write_pos.value = write
        self._write = write
        ring.bell.value = write & 0xFFFFFFFF
        return True

    def wake(self) -> bool:
        """Wake the client's threads asleep on the bell, if it counts any; True if it
        did. Called after `put`: a sleeper that read the bell before the record sees
        it changed, or is woken here."""
        ring = self._ring
        # The bell's store must be seen before the sleepers are read: a client that
        # counted itself a sleeper after this read sees the new bell in its futex wait.
        futex.fence()
        if not ring.sleepers.value:
            return False
        futex.wake(ring.bell)
        return True

    def close(self) -> None:
        self._ring.close()


class RingReader:
    """The client's end: creates the ring and takes the daemon's records in order."""

    def __init__(self, capacity: int, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) -> None:
        if capacity % 8 or capacity < 4096:
            raise ValueError(f"reply ring capacity: expected a multiple of 8 of at least 4096 bytes, got {capacity}")
        nbytes = segment_bytes(capacity)
        self.fd: int | None = os.memfd_create("hybridd-reply-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            if seals:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
            mapping = mmap.mmap(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        struct.pack_into("<QQ", mapping, 0, MAGIC, capacity)
        self._ring = _Mapping(f"memfd {self.fd}", mapping, capacity)
        self._read = 0
        # The record `next_number` found: where it starts, its payload's length, the position after it.
        self._at = self._length = self._next = 0
        self._closing = False
        self._lock = threading.Lock()  # the count of sleepers and the closing, between the client's threads

    @property
    def nbytes(self) -> int:
        return segment_bytes(self._ring.capacity)

    def release_fd(self) -> None:
        """Close the descriptor once the daemon has opened it: the mappings live on."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def next_number(self) -> int | None:
        """The number of the next record, without taking it or copying its payload; None
        when there is none."""
        ring = self._ring
        capacity = ring.capacity
        while True:
            write = ring.write_pos.value
            if self._read == write:
                return None
            offset = self._read % capacity
            (length,) = struct.unpack_from("<I", ring.map, HEADER_BYTES + offset)
            if length == WRAP:
                self._read += capacity - offset
                ring.read_pos.value = self._read
                continue
            end = self._read + _RECORD.size + _padded(length)
            if offset + _RECORD.size + length > capacity or end > write:
                raise RingBroken(f"reply ring record of {length} bytes at {self._read} runs past the daemon's writes")
            self._at, self._length, self._next = HEADER_BYTES + offset, length, end
            return _RECORD.unpack_from(ring.map, self._at)[2]

    def has_records(self) -> bool:
        """Whether the daemon has written records this reader has not taken (a look at
        the positions alone, for a thread other than the one that takes them)."""
        return self._ring.write_pos.value != self._read

    def payload(self) -> bytes:
        """A copy of the payload of the record `next_number` found."""
        start = self._at + _RECORD.size
        return self._ring.map[start:start + self._length]

    def peek(self) -> tuple[int, bytes] | None:
        """The next record (number, payload), without taking it; None when there is none."""
        number = self.next_number()
        return None if number is None else (number, self.payload())

    def advance(self) -> None:
        """Take the record `next_number` (or `peek`) found: its space is the daemon's again."""
        self._read = self._next
        self._ring.read_pos.value = self._read

    # ---------------------------------------------------------------- sleeping until a reply

    @contextmanager
    def sleeping(self) -> Iterator[None]:
        """Count the calling thread as a sleeper (in the ring's header, where the daemon
        reads it), so that the daemon wakes the bell after writing records; `bell()`
        and `sleep()` are called inside."""
        with self._lock:
            if self._closing:
                raise RingBroken("the reply ring is closed")
            self._ring.sleepers.value += 1
        try:
            yield
        finally:
            with self._lock:
                self._ring.sleepers.value -= 1
                if self._closing and not self._ring.sleepers.value:
                    self._ring.close()  # the last sleeper out unmaps what `close` left mapped

    def bell(self) -> int:
        """The bell's value: read it before looking for a reply, sleep on it after."""
        return self._ring.bell.value

    def sleep(self, bell: int, timeout_s: float) -> None:
        """Sleep while the bell holds `bell` (no record written, no `ring_bell`), for at
        most `timeout_s`; only inside `sleeping()`."""
        futex.wait(self._ring.bell, bell, timeout_s)

    def ring_bell(self) -> None:
        """Wake this process's sleepers: a reply they may wait for came another way."""
        ring = self._ring
        ring.bell.value ^= _BELL_FLIP
        futex.fence()
        if ring.sleepers.value:
            futex.wake(ring.bell)

    def close(self) -> None:
        """Unmap the ring, at once or, while threads sleep on it, when the last leaves
        (they are woken and find it closing)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self.release_fd()
            if self._ring.sleepers.value:
                self.ring_bell()
            else:
                self._ring.close()

    @property
    def closing(self) -> bool:
        return self._closing
