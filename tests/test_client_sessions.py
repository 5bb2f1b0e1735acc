"""ClientSessions on a real ROUTER with real DEALER clients: a disconnect ends exactly the
session that was on the connection, even when the next connection gets the same file
descriptor; messages queued behind a disconnect are not admitted; an outbox keeps
replies in order while the peer does not read and hands them over once it does."""

from __future__ import annotations

import time

import pytest
import zmq

from hybridd.ipc.channel import Channel
from hybridd.workers.client_sessions import ClientSessions, client_chosen, socket_options


@pytest.fixture
def router(tmp_path):
    context = zmq.Context()
    channel = Channel(zmq.ROUTER, context=context)
    for option, value in socket_options("ipc").items():
        channel.socket.setsockopt(option, value)
    endpoint = f"ipc://{tmp_path}/s.sock"
    sessions = ClientSessions(channel)  # before the bind, so it sees the first connection
    channel.bind(endpoint)
    yield context, channel, sessions, endpoint
    sessions.close()
    channel.close()
    context.destroy(linger=0)


def _dealer(context, endpoint, **options):
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    for option, value in options.items():
        dealer.setsockopt(getattr(zmq, option), value)
    dealer.connect(endpoint)
    return dealer


def _receive(channel, sessions, timeout=5.0):
    """The next message, admitted or not: (routing id, admitted)."""
    received = channel.recv_from(int(timeout * 1000))
    assert received is not None, "no message"
    routing_id, _ = received
    return routing_id, sessions.admit(routing_id, channel.last_peer_fd)


def _ended_within(sessions, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sessions.poll_events()
        ended = sessions.ended()
        if ended:
            return ended
        time.sleep(0.01)
    return []


def test_a_disconnect_ends_the_session_on_that_connection_even_when_its_descriptor_is_reused(router):
    context, channel, sessions, endpoint = router
    ping = b"\x81\xa1v\x01"
    current = _dealer(context, endpoint)
    current.send(ping)
    current_id, admitted = _receive(channel, sessions)
    assert admitted and not client_chosen(current_id)
    reused = 0
    for _ in range(20):
        fd = channel.last_peer_fd
        current.close()
        # The daemon has not looked at the disconnect yet when the next connection,
        # possibly on the same descriptor, sends its first message.
        assert sessions.monitor.poll(5000)
        time.sleep(0.02)
        following = _dealer(context, endpoint)
        following.send(ping)
        following_id, admitted = _receive(channel, sessions)
        assert admitted and following_id != current_id
        reused += channel.last_peer_fd == fd
        assert _ended_within(sessions) == [current_id]
        assert sessions.sessions == 1
        current, current_id = following, following_id
    assert reused, "no descriptor was reused: the race was never exercised"
    current.close()
    assert _ended_within(sessions) == [current_id]
    assert sessions.sessions == 0


def test_a_message_queued_behind_its_disconnect_is_not_admitted(router):
    context, channel, sessions, endpoint = router
    ping = b"\x81\xa1v\x01"
    gone = _dealer(context, endpoint)
    gone.send(ping)
    gone.send(ping)
    routing_id, admitted = _receive(channel, sessions)
    assert admitted
    gone.close()
    assert _ended_within(sessions) == [routing_id]
    again, admitted = _receive(channel, sessions)  # the second message, read after the disconnect
    assert again == routing_id and not admitted


def test_client_chosen_routing_ids_are_recognised(router):
    context, channel, sessions, endpoint = router
    chooser = _dealer(context, endpoint, ROUTING_ID=b"mine")
    chooser.send(b"\x81\xa1v\x01")
    routing_id, _ = _receive(channel, sessions)
    assert routing_id == b"mine" and client_chosen(routing_id)
    chooser.close()


def test_an_outbox_keeps_order_while_the_peer_does_not_read(router):
    context, channel, sessions, endpoint = router
    reader = _dealer(context, endpoint, RCVHWM=1)
    reader.send(b"\x81\xa1v\x01")
    routing_id, _ = _receive(channel, sessions)
    frames = [f"{n:08d}".encode() * 64 for n in range(5000)]  # more than the transport holds
    backlogs = [sessions.send(routing_id, frame) for frame in frames]
    assert max(backlogs) > 0 and sessions.pending, "the transport took everything; nothing was queued"
    received = []
    deadline = time.monotonic() + 30
    while len(received) < len(frames) and time.monotonic() < deadline:
        sessions.flush()
        while reader.poll(0):
            received.append(reader.recv())
    assert received == frames
    assert not sessions.pending


def test_a_client_connected_before_tracking_began_would_be_refused_so_tracking_must_precede_the_bind(tmp_path):
    """A connection accepted before the monitor is attached is never reported, and its
    session would be refused as ended forever: tracking a bound socket is refused."""
    context = zmq.Context()
    channel = Channel(zmq.ROUTER, context=context)
    channel.bind(f"ipc://{tmp_path}/late.sock")
    try:
        with pytest.raises(ValueError, match="before the socket binds"):
            ClientSessions(channel)
    finally:
        channel.close()
        context.destroy(linger=0)


def test_a_client_already_waiting_when_the_endpoint_binds_is_admitted(tmp_path):
    """A client that connected while the daemon was still starting (its connect retries
    until the socket exists) gets a live session on the first message."""
    from hybridd.ipc.channel import bind_ipc_endpoint
    from hybridd.protocol import codec

    context = zmq.Context()
    path = tmp_path / "early.sock"
    early = _dealer(context, f"ipc://{path}")
    early.send(codec.encode({"v": 1, "id": "early", "type": "health"}))
    tracked = []
    channel = bind_ipc_endpoint(path, context=context, decoder=codec.REQUESTS,
                                before_bind=lambda ch: tracked.append(ClientSessions(ch)))
    try:
        routing_id, admitted = _receive(channel, tracked[0], timeout=30)
        assert admitted
    finally:
        tracked[0].close()
        early.close(linger=0)
        channel.close()
        context.destroy(linger=0)
