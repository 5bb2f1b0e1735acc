"""Channels over real ZeroMQ sockets: DEALER/ROUTER over ipc://, bad input, endpoint ownership."""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from hybridd.ipc.channel import (
    RUNTIME_DIR_MODE,
    Channel,
    EndpointInUseError,
    PeerProtocolError,
    bind_ipc_endpoint,
)
from hybridd.protocol import limits
from hybridd.protocol import codec
from hybridd.protocol.codec import encode
from hybridd.protocol.control import Launched
from hybridd.protocol.errors import ErrorCode, ProtocolError
from hybridd.protocol.messages import ErrorReply, HealthReply, HealthRequest

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def runtime_dir(tmp_path_factory) -> Path:
    # Short: Unix socket paths are limited to 107 bytes.
    return Path(tmp_path_factory.mktemp("rt", numbered=True)) / "run"


def _dealer(path: Path) -> Channel:
    channel = Channel(zmq.DEALER, decoder=codec.REPLIES, name="test-client")
    channel.connect(f"ipc://{path}")
    return channel


def _answer_health(server: Channel, timeout_ms: int = 2000) -> None:
    received = server.recv_from(timeout_ms)
    assert received is not None, "no request arrived"
    identity, request = received
    server.send_to(identity, HealthReply(id=request.id, state="ready", ok=True))


def _serve_health(path: str, ready, stop) -> None:
    """Child process: a live server on `path` that answers health until told to stop."""
    server = bind_ipc_endpoint(path, decoder=codec.REQUESTS)
    ready.set()
    while not stop.is_set():
        try:
            received = server.recv_from(50)
        except ProtocolError:
            continue
        if received is not None:
            identity, request = received
            server.send_to(identity, HealthReply(id=request.id, state="ready", ok=True))
    server.close()


def _bind_and_hang(path: str, ready) -> None:
    """Child process: binds, then waits to be SIGKILLed (leaving a stale socket file)."""
    server = bind_ipc_endpoint(path, decoder=codec.REQUESTS)
    ready.set()
    time.sleep(60)
    server.close()


def test_dealer_router_round_trip(runtime_dir):
    path = runtime_dir / "d.sock"
    with bind_ipc_endpoint(path, decoder=codec.REQUESTS) as server, _dealer(path) as client:
        client.send(HealthRequest(id="h-1"))
        identity, request = server.recv_from(2000)
        assert request == HealthRequest(id="h-1")
        assert server.send_to(identity, HealthReply(id="h-1", state="ready", ok=True))
        assert client.recv(2000) == HealthReply(id="h-1", state="ready", ok=True)
        assert client.recv(0) is None and server.recv_from(0) is None
        assert (server.stats.received, server.stats.sent) == (1, 1)


def test_malformed_message_raises_and_the_next_one_works(runtime_dir):
    path = runtime_dir / "m.sock"
    with bind_ipc_endpoint(path, decoder=codec.REQUESTS) as server, _dealer(path) as client:
        client.socket.send(b"\xc1garbage")
        with pytest.raises(PeerProtocolError) as info:
            server.recv_from(2000)
        assert info.value.code is ErrorCode.MALFORMED
        assert server.send_error_to(info.value.identity, info.value)
        reply = client.recv(2000)
        assert isinstance(reply, ErrorReply) and (reply.id, reply.code) == ("", ErrorCode.MALFORMED)

        # A REQ-style empty delimiter frame is a protocol violation, reported as such.
        client.socket.send_multipart([b"", encode(HealthRequest(id="h-2"))])
        with pytest.raises(PeerProtocolError, match="delimiter"):
            server.recv_from(2000)

        client.socket.send(msgpack.packb({"v": 9, "type": "health", "id": "h-3"}))
        with pytest.raises(PeerProtocolError) as info:
            server.recv_from(2000)
        assert (info.value.code, info.value.request_id) == (ErrorCode.UNSUPPORTED_VERSION, "h-3")

        client.send(HealthRequest(id="h-4"))
        _answer_health(server)
        assert client.recv(2000).id == "h-4"
        assert server.stats.rejected == {"malformed": 2, "unsupported_version": 1}


def test_oversized_frame_is_dropped_and_the_socket_stays_usable(runtime_dir):
    path = runtime_dir / "o.sock"
    with bind_ipc_endpoint(path, decoder=codec.REQUESTS) as server, _dealer(path) as offender, _dealer(path) as bystander:
        offender.socket.send(b"\x00" * (limits.MAX_MESSAGE_BYTES + 1))
        assert server.recv_from(300) is None  # ZeroMQ drops it (and that connection)

        bystander.send(HealthRequest(id="ok-1"))
        _answer_health(server)
        assert bystander.recv(2000).id == "ok-1"

        # The offender reconnects on its own; its later messages get through.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            offender.send(HealthRequest(id="again"))
            received = server.recv_from(200)
            if received is not None:
                assert received[1].id == "again"
                break
        else:
            pytest.fail("the offending client never got through again")


def test_a_peer_that_is_gone_is_unroutable(runtime_dir):
    path = runtime_dir / "g.sock"
    with bind_ipc_endpoint(path, decoder=codec.REQUESTS) as server:
        assert not server.send_to(b"\x00nobody", HealthReply(id="x", state="ready", ok=True))
        assert server.stats.unroutable == 1


def test_second_bind_on_a_live_endpoint_refuses(runtime_dir):
    path = runtime_dir / "live.sock"
    ready, stop = SPAWN.Event(), SPAWN.Event()
    child = SPAWN.Process(target=_serve_health, args=(str(path), ready, stop))
    child.start()
    try:
        assert ready.wait(30)
        with pytest.raises(EndpointInUseError) as info:
            bind_ipc_endpoint(path, decoder=codec.REQUESTS)
        assert str(path) in str(info.value) and str(child.pid) in str(info.value)
        with _dealer(path) as client:  # the live server was not disturbed
            client.send(HealthRequest(id="still-there"))
            assert client.recv(5000).id == "still-there"
    finally:
        stop.set()
        child.join(10)
    assert child.exitcode == 0
    assert not path.exists(), "the server's socket file must be removed on close"


def test_a_foreign_server_that_answers_health_is_detected(runtime_dir):
    path = runtime_dir / "foreign.sock"
    runtime_dir.mkdir(parents=True)
    foreign = zmq.Context.instance().socket(zmq.ROUTER)
    foreign.setsockopt(zmq.LINGER, 0)
    foreign.bind(f"ipc://{path}")
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            if foreign.poll(20):
                identity, frame = foreign.recv_multipart()
                foreign.send_multipart([identity, frame])

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with pytest.raises(EndpointInUseError, match="health probe"):
            bind_ipc_endpoint(path, decoder=codec.REQUESTS)
    finally:
        stop.set()
        thread.join()
        foreign.close()


def test_stale_socket_file_is_taken_over(runtime_dir):
    path = runtime_dir / "stale.sock"
    ready = SPAWN.Event()
    child = SPAWN.Process(target=_bind_and_hang, args=(str(path), ready))
    child.start()
    assert ready.wait(30)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert stat.S_ISSOCK(path.lstat().st_mode), "SIGKILL leaves the socket file behind"

    with bind_ipc_endpoint(path, decoder=codec.REQUESTS, probe_timeout_ms=100) as server, _dealer(path) as client:
        client.send(HealthRequest(id="new"))
        _answer_health(server)
        assert client.recv(2000).id == "new"
    assert not path.exists()


def test_runtime_dir_is_created_0750_even_with_a_lax_umask(runtime_dir):
    path = runtime_dir / "deep" / "x.sock"
    old = os.umask(0)
    try:
        channel = bind_ipc_endpoint(path, decoder=codec.REQUESTS)
    finally:
        os.umask(old)
    with channel:
        assert stat.S_IMODE(path.parent.stat().st_mode) == RUNTIME_DIR_MODE
        assert stat.S_ISSOCK(path.lstat().st_mode)
    assert not path.exists()
    channel.close()  # idempotent
    assert channel.closed


def test_bind_refuses_a_regular_file_and_an_overlong_path(runtime_dir):
    runtime_dir.mkdir(parents=True)
    squatter = runtime_dir / "file.sock"
    squatter.write_text("not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        bind_ipc_endpoint(squatter)
    assert squatter.read_text() == "not a socket"
    with pytest.raises(ValueError, match="107"):
        bind_ipc_endpoint(runtime_dir / ("x" * 120))


def test_pair_channel_between_processes_uses_the_same_framing(runtime_dir):
    path = runtime_dir / "ctl.sock"
    with bind_ipc_endpoint(path, socket_type=zmq.PAIR, decoder=codec.CONTROL) as a:
        b = Channel(zmq.PAIR)
        b.connect(f"ipc://{path}")
        with b:
            b.send({"v": 1, "type": "launched", "step": 3})
            assert a.recv(2000) == Launched(v=1, step=3)
            b.send(Launched(step=4))
            assert a.recv(2000) == Launched(step=4)
        with pytest.raises(TypeError):
            a.recv_from(0)


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_encrypted_tcp(tmp_path):
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    with Channel(zmq.ROUTER) as server, Channel(zmq.DEALER) as client, Channel(zmq.DEALER) as plain:
        server.use_curve_server(server_secret)
        endpoint = server.bind("tcp://127.0.0.1:0")
        # The client side's keys, as the SDK sets them on its own socket.
        client.socket.curve_serverkey = server_public
        client.socket.curve_publickey = client_public
        client.socket.curve_secretkey = client_secret
        client.connect(endpoint)
        plain.connect(endpoint)
        plain.send(HealthRequest(id="plain"))
        client.send(HealthRequest(id="curve"))
        identity, data = server.recv_from(5000)
        assert data["id"] == "curve"
        assert server.recv_from(300) is None  # the unencrypted client never gets through
