"""The client's side of a reply ring: each reply delivered once, in order, from
whichever of the two paths brings it first.

After `ring_attached` the daemon numbers the session's replies 1, 2, ... and writes each
to the ring (when it has room) before it sends it on the socket (ipc/reply_ring.py). The
socket carries every reply, so its k-th frame after `ring_attached` is reply k; the ring
carries a reply's number in its record. The next reply to deliver is always
`delivered + 1`: a copy with a smaller number was delivered already, and a ring record
with a larger one (the ring had no room for some before it) waits until the socket has
brought the ones in between.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterator

from hybridd.ipc.reply_ring import RingReader

# A client's `reply_ring` by default: a ring wherever one can be had (an ipc:// endpoint,
# an x86-64 host), the socket alone where the daemon does not attach it.
AUTO_RING = "auto"
DEFAULT_RING_BYTES = 1 << 20
# How long a stream's reader polls the ring for its next reply, by default, before it
# sleeps on the ring's bell: not at all. Asleep, it is woken by the daemon itself right
# after the reply is written, about as soon as a polling reader would see it
# (docs/lab/benchmarks.md, "The reply ring"), and keeps no core busy.
RING_SPIN_S = 0.0
MAX_RING_SPIN_S = 10.0
# The longest single sleep on the bell: a sleeper looks again at least this often.
RING_SLEEP_S = 0.5
# How long before a stream's next reply is due its reader wakes by itself to poll the
# ring, and how long past that time it goes on polling before it sleeps on the bell
# again, by default. A thread woken by the bell reaches the reply one scheduler wake-up
# after it was written, and that wake-up is what lengthens a stream's slowest gaps; a
# thread already polling when the reply lands takes it at once. Polling only around the
# time a reply is due costs a fraction of a core (about twice this in each gap), not a
# whole one (docs/lab/benchmarks.md, "The reply ring").
RING_PACE_S = 0.0005
MAX_RING_PACE_S = 0.1
# How long a stream's reader polls the ring for the stream's first chunk, from the
# request's submission, before it sleeps on the bell, by default. Nothing says when the
# first chunk is due, but on a daemon with room it comes within milliseconds (the
# prompt's prefill), and a reader already polling saves it the wake-up; the bound keeps
# a request that waits behind others from holding a core for that wait.
RING_FIRST_POLL_S = 0.02
MAX_RING_FIRST_POLL_S = 10.0
# The gaps of a stream's recent replies whose median says when the next one is due.
PACE_GAPS = 8


class ReplyPacer:
    """When a stream's reader polls for its next reply: for its first, from the request's
    submission for `first_s`; for the others, in a window of `window_s` either side of
    the time the reply is due (the last reply's time plus the median of the stream's last
    `PACE_GAPS` gaps). Between the first reply and the second nothing is due; 0 turns
    either off."""

    def __init__(self, window_s: float, first_s: float = 0.0, submitted: float = 0.0) -> None:
        self.window_s = window_s
        self.first_s = first_s
        self._submitted = submitted
        self._last: float | None = None
        self._gaps: deque[float] = deque(maxlen=PACE_GAPS)
        self.caught = 0  # replies the reader found while polling in a window

    def arrived(self, now: float) -> None:
        """A reply of the stream was taken at `now` (time.monotonic())."""
        if self._last is not None:
            self._gaps.append(now - self._last)
        self._last = now

    def window(self) -> tuple[float, float] | None:
        """(poll from, poll until) in time.monotonic() for the next reply, or None."""
        if self._last is None:
            return (self._submitted, self._submitted + self.first_s) if self.first_s else None
        if not self.window_s or not self._gaps:
            return None
        due = self._last + statistics.median(self._gaps)
        return due - self.window_s, due + self.window_s


class RingDelivery:
    """The numbering of one attached ring's session; not thread-safe (the session
    serialises its callers)."""

    def __init__(self, reader: RingReader) -> None:
        self.reader = reader
        self.socket_number = 0  # of the last socket frame since `ring_attached`
        self.delivered = 0  # the number of the last reply delivered
        self.by_ring = 0  # replies the ring delivered (before the socket)

    def from_socket(self) -> bool:
        """Count one socket frame; True when it is the next reply to deliver (the ring has
        not brought it)."""
        self.socket_number += 1
        if self.socket_number <= self.delivered:
            return False
        self.delivered = self.socket_number
        self.skip_delivered()
        return True

    def from_ring(self) -> Iterator[bytes]:
        """The payloads of the ring's records that are next in order, taken as they are
        yielded."""
        reader = self.reader
        while (number := reader.next_number()) is not None:
            if number > self.delivered + 1:
                return
            if number <= self.delivered:
                reader.advance()  # the socket brought it
                continue
            payload = reader.payload()
            reader.advance()
            self.delivered = number
            self.by_ring += 1
            yield payload

    def skip_delivered(self) -> None:
        """Take the ring's records the socket delivered already, so that a ring nobody
        polls does not stay full."""
        reader = self.reader
        while (number := reader.next_number()) is not None and number <= self.delivered:
            reader.advance()

    def close(self) -> None:
        self.reader.close()
