"""The reply rings of the context generator's client sessions: attach, write, detach.

A session may attach one ring (`attach_ring`, ipc/reply_ring.py). Every reply sent to
the session after the `ring_attached` reply is written to its ring before it goes to
the socket; a ring with no room leaves the reply to the socket. The client's threads
asleep on a ring are woken at its first record of a batch of replies (a step's chunks,
a pass of the serving loop) and once more at the batch's end if more records followed:
a client with many streams wakes its sleepers about twice a step, not once a record.
A ring whose client wrote a read position the daemon never gave it is detached, with a
warning, and the session goes on over its socket, which has carried every reply all
along. A session's ring is detached when the session ends.
"""

from __future__ import annotations

from hybridd.ipc import reply_ring
from hybridd.log import get_logger
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.messages import AttachRingRequest

log = get_logger("reply_rings")


class ReplyRings:
    """Each session's attached ring, by the session's identity."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # rings attached at once (the daemon's max_reply_rings)
        self._rings: dict[bytes, reply_ring.RingWriter] = {}
        self.written = 0  # replies written to a ring
        self.left_out = 0  # replies a ring had no room for
        self.wakes = 0  # times a ring's sleepers were woken
        self._woken: set[bytes] = set()  # rings woken in this batch
        self._unwoken: set[bytes] = set()  # rings with records since their wake in this batch

    def __len__(self) -> int:
        return len(self._rings)

    def open(self, identity: bytes, request: AttachRingRequest, peer_fd: int | None) -> reply_ring.RingWriter:
        """Map the ring `request` names for the session; ProtocolError says why not.
        `peer_fd` is the session's Unix socket (None over TCP)."""
        if peer_fd is None:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "attach_ring: only a client on the daemon's host, "
                                "connected over ipc://, can attach a reply ring")
        if not reply_ring.supported():
            raise ProtocolError(ErrorCode.UNAVAILABLE, "attach_ring: reply rings need an x86-64 host; "
                                "replies come by the socket")
        if identity in self._rings:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "attach_ring: this session has a reply ring already")
        if len(self._rings) >= self.limit:
            raise ProtocolError(ErrorCode.OVERLOADED, f"attach_ring: {len(self._rings)} reply rings are attached, "
                                f"the daemon's max_reply_rings; replies come by the socket")
        try:
            pid = reply_ring.peer_pid(peer_fd)
            return reply_ring.RingWriter(pid, request.fd, request.bytes)
        except (OSError, ValueError) as exc:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"fd: cannot attach the reply ring: {exc}",
                                field="fd") from None

    def attach(self, identity: bytes, ring: reply_ring.RingWriter) -> None:
        """Write the session's replies from now on to `ring` too (after its `ring_attached`)."""
        self._rings[identity] = ring

    def put(self, identity: bytes, frame: bytes) -> None:
        """Write a reply to the session's ring, if it has one (before the socket sends it)."""
        ring = self._rings.get(identity)
        if ring is None:
            return
        try:
            if not ring.put(frame):
                self.left_out += 1
                return
            self.written += 1
            if identity in self._woken:
                self._unwoken.add(identity)
            else:
                self._woken.add(identity)
                self.wakes += ring.wake()
        except reply_ring.RingBroken as exc:
            log.warning("reply ring detached; the session's replies go by its socket alone", reason=str(exc))
            self.detach(identity)

    def end_batch(self) -> None:
        """Wake the rings that took records since their wake in this batch, and start
        the next batch."""
        if not self._woken:  # no record in this batch (most passes of the loop)
            return
        for identity in self._unwoken:
            ring = self._rings.get(identity)
            if ring is not None:
                self.wakes += ring.wake()
        self._unwoken.clear()
        self._woken.clear()

    def detach(self, identity: bytes) -> None:
        ring = self._rings.pop(identity, None)
        if ring is not None:
            ring.close()

    def close(self) -> None:
        for identity in list(self._rings):
            self.detach(identity)
