"""The sessions of one client-facing ROUTER socket: who is connected, and their outboxes.

A session is one client connection, named by the daemon. ZeroMQ's ROUTER gives each
connection that does not choose its own routing id a fresh one (5 bytes, the first
zero) that is never reused while the socket lives. A connection that sets
`ZMQ_ROUTING_ID` could step into a session that has just disconnected, so its
messages are refused (`client_chosen`): no connection can receive another's replies.

A disconnect ends the session at once. The socket monitor reports each connection's
accept and disconnect by file descriptor, and every message carries the descriptor
it came in on (`ZMQ_SRCFD`): the k-th accept on a descriptor starts its k-th
connection, the k-th disconnect ends it, and a routing id belongs to the connection
that was open on its descriptor when its first message arrived. A reply the socket
can no longer route (the peer is gone) ends the session too. The owner collects
ended sessions with `ended()` and cancels their requests.

Replies never block the serving loop and are never silently dropped: a frame the
transport will not take (the client is not reading and its queue is at the high-water
mark) waits in the session's outbox, in order, and later frames queue behind it.
How long an outbox may grow before the session's requests are ended is the owner's
rule (see `SESSION_BACKLOG_LIMIT`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque

import zmq
from zmq.utils.monitor import parse_monitor_message

from hybridd.ipc.channel import Channel, Delivery
from hybridd.log import get_logger

log = get_logger("client_sessions")

# Routing ids ZeroMQ assigns: a zero byte, then a 32-bit counter.
ASSIGNED_ID_BYTES = 5
# Ended routing ids remembered, so that messages still queued behind a disconnect are
# discarded instead of opening a session nobody reads; ids are never reused, so
# forgetting the oldest only matters for a message delayed that long.
REMEMBERED_ENDED = 65_536
# The transport's share of a session's backlog: the ROUTER's per-connection queue and
# the kernel's buffer of a Unix socket. Beyond them a frame waits in the outbox, where
# the daemon can see it and apply the slow-consumer rule.
CLIENT_SEND_HWM = 100
IPC_SEND_BUFFER_BYTES = 64 * 1024


def socket_options(transport: str) -> dict[int, int]:
    """Options of a client ROUTER, set before it binds (a listener copies them then).
    TCP keeps the kernel's autotuned buffer: it is what a long path needs."""
    options = {zmq.SNDHWM: CLIENT_SEND_HWM}
    if transport == "ipc":
        options[zmq.SNDBUF] = IPC_SEND_BUFFER_BYTES
    return options


def client_chosen(routing_id: bytes) -> bool:
    """True when the connection set its own ZMQ_ROUTING_ID (ZeroMQ's start with a zero byte)."""
    return len(routing_id) != ASSIGNED_ID_BYTES or routing_id[0] != 0


class ClientSessions:
    """Connection tracking and outboxes of one ROUTER channel; identities carry `prefix`."""

    def __init__(self, channel: Channel, prefix: bytes = b"") -> None:
        """Track `channel`'s connections; made before the socket binds, or a connection
        accepted before the monitor is attached would never be reported (and its
        session refused as ended)."""
        if channel.socket.getsockopt(zmq.LAST_ENDPOINT):
            raise ValueError("ClientSessions must track a socket before the socket binds")
        self.channel = channel
        self.prefix = prefix
        # The monitor's queue is unbounded (RCVHWM 0 before connecting): a dropped event
        # would misattribute every later disconnect on its descriptor.
        address = f"inproc://client-sessions-{id(self):x}"
        channel.socket.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.monitor = channel.socket.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)
        self.monitor.connect(address)
        self._accepted: Counter[int] = Counter()
        self._disconnected: Counter[int] = Counter()
        self._connection: dict[bytes, tuple[int, int]] = {}  # routing id -> (fd, k-th connection on it)
        self._members: dict[tuple[int, int], set[bytes]] = {}
        self._ended: OrderedDict[bytes, None] = OrderedDict()
        self._gone: list[bytes] = []
        self._outboxes: dict[bytes, deque[bytes]] = {}
        self.ended_total = 0

    # ------------------------------------------------------------ connections

    def poll_events(self) -> None:
        """Apply every accept and disconnect the monitor has reported so far."""
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted[fd] += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnected[fd] += 1
                for routing_id in self._members.pop((fd, self._disconnected[fd]), ()):
                    self.end(routing_id)

    def admit(self, routing_id: bytes, fd: int) -> bool:
        """Whether a message from `routing_id` (arrived on descriptor `fd`) belongs to a
        live session; False for one that has ended, whose messages are discarded."""
        if routing_id in self._connection:
            return True
        if routing_id in self._ended:
            return False
        # The accept of the sender's connection was reported before its first message.
        self.poll_events()
        number = self._accepted[fd]
        if fd < 0 or number <= self._disconnected[fd]:
            self._remember_ended(routing_id)
            return False
        self._connection[routing_id] = (fd, number)
        self._members.setdefault((fd, number), set()).add(routing_id)
        return True

    def end(self, routing_id: bytes) -> None:
        """The session is over: its outbox is dropped; `ended()` reports it once."""
        connection = self._connection.pop(routing_id, None)
        if connection is None:
            return
        members = self._members.get(connection)
        if members is not None:
            members.discard(routing_id)
            if not members:
                del self._members[connection]
        self._outboxes.pop(routing_id, None)
        self._remember_ended(routing_id)
        self._gone.append(self.prefix + routing_id)
        self.ended_total += 1

    def ended(self) -> list[bytes]:
        """Identities (with the prefix) of the sessions that ended since the last call."""
        gone, self._gone = self._gone, []
        return gone

    def _remember_ended(self, routing_id: bytes) -> None:
        self._ended[routing_id] = None
        if len(self._ended) > REMEMBERED_ENDED:
            self._ended.popitem(last=False)

    @property
    def sessions(self) -> int:
        return len(self._connection)

    # ------------------------------------------------------------ replies

    def send(self, routing_id: bytes, frame: bytes) -> int:
        """Deliver or queue one frame; returns the session's backlog afterwards (frames
        waiting in its outbox), or -1 when the session has ended."""
        outbox = self._outboxes.get(routing_id)
        if outbox:
            outbox.append(frame)
            return len(outbox)
        delivery = self.channel.deliver(routing_id, frame)
        if delivery is Delivery.SENT:
            return 0
        if delivery is Delivery.GONE:
            self.end(routing_id)
            return -1
        if routing_id not in self._connection:  # a refused connection: nothing to keep
            return -1
        self._outboxes[routing_id] = deque([frame])
        return 1

    def backlog(self, routing_id: bytes) -> int:
        outbox = self._outboxes.get(routing_id)
        return len(outbox) if outbox else 0

    @property
    def pending(self) -> bool:
        return bool(self._outboxes)

    def flush(self) -> None:
        """Hand queued frames to the transport, oldest first, until each peer's queue is full."""
        for routing_id, outbox in list(self._outboxes.items()):
            while outbox:
                delivery = self.channel.deliver(routing_id, outbox[0])
                if delivery is Delivery.SENT:
                    outbox.popleft()
                    continue
                if delivery is Delivery.GONE:
                    self.end(routing_id)
                break
            if not outbox:
                self._outboxes.pop(routing_id, None)

    def close(self) -> None:
        self.channel.socket.disable_monitor()
        self.monitor.close(linger=0)
