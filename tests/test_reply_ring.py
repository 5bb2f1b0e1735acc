"""Reply rings: the ring itself over a real memfd, the client's choice between its two
copies of each reply, and the real daemon attaching, writing, refusing and detaching
rings for real clients (the SDK's two faces, the gateway over the async one, and the raw
protocol client)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.auth

from hybridd import AsyncClient, Client
from hybridd.gateway.app import Gateway, create_app
from hybridd.config import Config, ConfigError
from hybridd.client_ring import (
    DEFAULT_RING_BYTES, MAX_RING_FIRST_POLL_S, MAX_RING_PACE_S, MAX_RING_SPIN_S, PACE_GAPS, RING_FIRST_POLL_S,
    RING_PACE_S, ReplyPacer, RingDelivery,
)
from hybridd.ipc import reply_ring
from hybridd.ipc.reply_ring import HEADER_BYTES, RingBroken, RingReader, RingWriter
from hybridd.protocol import codec
from hybridd.protocol.limits import MAX_REPLY_RING_BYTES, MIN_REPLY_RING_BYTES
from tests.daemon import RunningDaemon, free_port, run_daemon
from tests.engine_pair import Client as RawClient
from tests.host_load import on_this_host, wait_for

pytestmark = pytest.mark.skipif(not reply_ring.supported(), reason="reply rings need x86-64")

LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0}


def pair(capacity: int = 4096, **reader_options) -> tuple[RingReader, RingWriter]:
    reader = RingReader(capacity, **reader_options)
    return reader, RingWriter(os.getpid(), reader.fd, reader.nbytes)


def drain(reader: RingReader) -> list[tuple[int, bytes]]:
    out = []
    while (record := reader.peek()) is not None:
        out.append((record[0], bytes(record[1])))
        reader.advance()
    return out


# ---------------------------------------------------------------- the ring


def test_records_come_out_in_order_across_the_wrap_and_a_full_ring_refuses():
    reader, writer = pair(4096)
    try:
        frames = [bytes([i % 251]) * (100 + 37 * i) for i in range(40)]
        taken = []
        for frame in frames:
            assert writer.put(frame)
            taken += drain(reader)  # read as it goes: the positions pass the end many times
        assert taken == list(enumerate(frames, start=1))
        fitted = 0
        while writer.put(b"x" * 100):  # 116 bytes a record: about 35 fill the ring
            fitted += 1
        assert 30 <= fitted <= 35
        assert not writer.put(b"z" * 5000)  # never fits
        assert drain(reader) == [(41 + i, b"x" * 100) for i in range(fitted)]
        assert writer.put(b"w" * 10)
        # The one refused when the ring was full and the one too large were left to the socket.
        assert drain(reader) == [(41 + fitted + 2, b"w" * 10)]
    finally:
        writer.close()
        reader.close()


def test_the_writer_refuses_what_is_not_a_fresh_sealed_ring_of_the_announced_size():
    reader = RingReader(4096)
    try:
        with pytest.raises(ValueError, match="holds 4352 bytes, the request says 8448"):
            RingWriter(os.getpid(), reader.fd, 8448)
        struct.pack_into("<Q", reader._ring.map, 0, 7)
        with pytest.raises(ValueError, match="is not a reply ring"):
            RingWriter(os.getpid(), reader.fd, reader.nbytes)
    finally:
        reader.close()
    unsealed = RingReader(4096, seals=0)
    try:
        with pytest.raises(ValueError, match="not a memfd sealed against shrinking"):
            RingWriter(os.getpid(), unsealed.fd, unsealed.nbytes)
    finally:
        unsealed.close()
    used, writer = pair()
    try:
        writer.put(b"abc")
        with pytest.raises(ValueError, match="is not fresh"):
            RingWriter(os.getpid(), used.fd, used.nbytes)
    finally:
        writer.close()
        used.close()
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ValueError, match=r"is not a memfd \(it is 'pipe:"):
            RingWriter(os.getpid(), read_end, 4352)
    finally:
        os.close(read_end)
        os.close(write_end)
    with open(__file__, "rb") as source:
        with pytest.raises(ValueError, match="is not a memfd .*test_reply_ring.py"):
            RingWriter(os.getpid(), source.fileno(), 4352)
    with pytest.raises(FileNotFoundError):
        RingWriter(os.getpid(), 1_000_000, 4352)


def test_a_sealed_ring_cannot_be_shrunk_under_the_daemon():
    reader = RingReader(4096)
    try:
        assert fcntl.fcntl(reader.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        with pytest.raises(PermissionError):
            os.ftruncate(reader.fd, 64)
    finally:
        reader.close()


def test_a_read_position_the_writer_never_gave_breaks_the_ring():
    reader, writer = pair()
    try:
        writer.put(b"abc")
        reader._ring.read_pos.value = 10_000  # past the writes
        with pytest.raises(RingBroken, match="read position 10000"):
            writer.put(b"def")
    finally:
        writer.close()
        reader.close()


# ---------------------------------------------------------------- sleeping on the bell

# Longer than any test waits: a sleeper that returns was woken, not timed out.
NEVER_S = 3600.0


def sleep_in_thread(reader: RingReader) -> tuple[threading.Thread, list[float]]:
    """A thread that counts itself a sleeper, reads the bell, then sleeps on it until
    woken; returned once it has read the bell (whatever rings it after that wakes it)."""
    slept: list[float] = []
    has_read = threading.Event()

    def sleeper() -> None:
        with reader.sleeping():
            bell = reader.bell()
            has_read.set()
            started = time.monotonic()
            reader.sleep(bell, NEVER_S)
            slept.append(time.monotonic() - started)

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    assert has_read.wait(on_this_host(10))
    return thread, slept


def test_the_writers_record_wakes_a_sleeping_reader_through_another_mapping():
    reader, writer = pair(4096)
    try:
        assert not writer.wake()  # nobody asleep: no wake
        thread, slept = sleep_in_thread(reader)
        assert writer._ring.sleepers.value == 1  # the daemon's mapping sees the sleeper
        assert writer.put(b"abc") and writer.wake()
        thread.join(on_this_host(10))
        assert not thread.is_alive() and slept  # woken by the write, not by a timeout
        assert writer._ring.sleepers.value == 0
        assert drain(reader) == [(1, b"abc")]
    finally:
        writer.close()
        reader.close()


def test_the_clients_bell_wakes_a_sleeper_and_a_close_wakes_it_and_waits_for_it():
    reader, writer = pair(4096)
    try:
        thread, slept = sleep_in_thread(reader)
        reader.ring_bell()  # a reply came by the socket instead
        thread.join(on_this_host(10))
        assert not thread.is_alive() and slept

        stayed = threading.Event()

        def sleeper_until_closed() -> None:
            with reader.sleeping():
                while not reader.closing:
                    reader.sleep(reader.bell(), NEVER_S)
                stayed.set()

        thread = threading.Thread(target=sleeper_until_closed, daemon=True)
        thread.start()
        wait_for(lambda: reader._ring.sleepers.value == 1)
        reader.close()
        thread.join(on_this_host(10))
        assert not thread.is_alive() and stayed.is_set()
        assert reader._ring.map.closed  # unmapped by the last sleeper out, not under it
        with pytest.raises(RingBroken, match="closed"):
            with reader.sleeping():
                pass
    finally:
        writer.close()
        reader.close()


# ---------------------------------------------------------------- one copy of each reply


def test_each_reply_is_delivered_once_in_order_whichever_path_brings_it():
    reader, writer = pair(4096)
    delivery = RingDelivery(reader)
    try:
        for i in range(1, 4):
            writer.put(b"r%d" % i)
        assert [bytes(p) for p in delivery.from_ring()] == [b"r1", b"r2", b"r3"]
        assert [delivery.from_socket() for _ in range(3)] == [False, False, False]  # the copies
        assert delivery.from_socket()  # reply 4 came by the socket first
        writer.put(b"r4")
        writer.put(b"r5")
        assert [bytes(p) for p in delivery.from_ring()] == [b"r5"]  # its copy of 4 skipped
        assert not writer.put(b"x" * 4000)  # 6: no room, the socket alone carries it
        assert not delivery.from_socket()  # the socket's copy of 5
        writer.put(b"r7")
        assert list(delivery.from_ring()) == []  # 7 waits for 6
        assert delivery.from_socket()  # 6 by the socket
        assert [bytes(p) for p in delivery.from_ring()] == [b"r7"]
        assert delivery.by_ring == 5 and delivery.delivered == 7
    finally:
        writer.close()
        delivery.close()


# ---------------------------------------------------------------- the daemon


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("keys")
    zmq.auth.create_certificates(directory, "server")
    zmq.auth.create_certificates(directory, "client")
    return directory


@pytest.fixture(scope="module")
def daemon(keys) -> Iterator[RunningDaemon]:
    port = free_port()
    with run_daemon("--tcp-endpoint", f"tcp://127.0.0.1:{port}", "--curve-secret-key-file",
                    str(keys / "server.key_secret"), "--curve-allow-any",
                    env={"HYBRIDD_MAX_REPLY_RINGS": "2"}) as running:
        running.tcp_endpoint = f"tcp://127.0.0.1:{port}"
        yield running


@pytest.fixture
def raw(daemon) -> Iterator[RawClient]:
    context = zmq.Context()
    client = RawClient(context, daemon.endpoint, version=2)
    yield client
    client.close()
    context.term()


def rings(daemon) -> dict:
    with Client(daemon.endpoint, timeout=30, reply_ring=False) as client:
        return client.status()["reply_rings"]


def ringed_client(daemon) -> Client:
    client = Client(daemon.endpoint, timeout=120, reply_ring=True)
    client.health()
    wait_for(lambda: client._session.ring_attached)
    return client


def test_a_ring_client_streams_what_a_plain_client_does_mostly_by_the_ring(daemon):
    with Client(daemon.endpoint, timeout=120, reply_ring=False) as plain, ringed_client(daemon) as ringed:
        expected = plain.generate("ROMEO:", **LONG).token_ids
        before = rings(daemon)
        stream = ringed.stream("ROMEO:", **LONG)
        chunks = list(stream)
        assert [t for c in chunks for t in c.token_ids] == expected
        assert stream.result.token_ids == expected and stream.result.finish_reason == "length"
        after = rings(daemon)
        assert after["attached"] >= 1
        assert after["written"] - before["written"] >= len(chunks) + 1  # every chunk, the final, status
        delivery = ringed._session._ring
        assert delivery.by_ring > 0  # the poller took replies off the ring before the socket brought them
        # Another thread's non-streaming call is served in between, off either path.
        assert ringed.generate("ROMEO:", **LONG).token_ids == expected


async def ring_attached(client: AsyncClient) -> None:
    """Await the ring the client's session asks for on connecting (its answer comes first)."""
    await client.health()
    deadline = time.monotonic() + on_this_host(30)
    while not client._session.ring_attached:
        assert time.monotonic() < deadline, "the daemon did not attach the async client's ring"
        await asyncio.sleep(0.01)


def test_an_async_client_takes_its_replies_off_the_ring_woken_through_its_loop(daemon):
    wait_for(lambda: rings(daemon)["attached"] == 0)  # the sessions of earlier tests have ended
    with Client(daemon.endpoint, timeout=120, reply_ring=False) as plain:
        expected = plain.generate("ROMEO:", **LONG).token_ids

    async def run() -> tuple:
        async with AsyncClient(daemon.endpoint, timeout=120) as client:  # a ring by default
            await ring_attached(client)
            delivery = client._session._ring
            stream = client.stream("ROMEO:", **LONG)
            tokens = [t async for chunk in stream for t in chunk.token_ids]
            streamed_by_ring = delivery.by_ring
            whole = await asyncio.gather(*(client.generate("ROMEO:", **LONG) for _ in range(3)))
            # A whole reply is one message: on a busy host its socket copy may win the race each
            # time, so short requests follow, up to 60, until one's reply comes off the ring.
            for _ in range(20):
                if delivery.by_ring > streamed_by_ring:
                    break
                await asyncio.gather(*(client.generate("ROMEO:", max_tokens=4) for _ in range(3)))
            return tokens, stream.result, streamed_by_ring, whole, delivery.by_ring

    tokens, result, streamed_by_ring, whole, by_ring = asyncio.run(run())
    assert tokens == expected and result.token_ids == expected and result.finish_reason == "length"
    assert streamed_by_ring > 0  # the loop took replies off the ring before the socket brought them
    assert [r.token_ids for r in whole] == [expected] * 3
    assert by_ring > streamed_by_ring
    # Refused a ring (asked for none here), the async client goes on by its socket.
    async def plain_async() -> list[int]:
        async with AsyncClient(daemon.endpoint, timeout=120, reply_ring=False) as client:
            ids = [t async for chunk in client.stream("ROMEO:", **LONG) for t in chunk.token_ids]
            assert not client._session.ring_attached
            return ids

    assert asyncio.run(plain_async()) == expected


def test_the_gateway_serves_its_completions_by_the_ring(daemon):
    """The HTTP gateway's routes over its AsyncClient (in this process, through ASGI):
    what a completion streams came off the reply ring."""
    wait_for(lambda: rings(daemon)["attached"] == 0)
    with Client(daemon.endpoint, timeout=120, reply_ring=False) as plain:
        expected = plain.generate("ROMEO:", max_tokens=60, temperature=0.0).text

    async def run() -> tuple[str, int]:
        client = AsyncClient(daemon.endpoint, timeout=120)
        try:
            await ring_attached(client)
            transport = httpx.ASGITransport(app=create_app(Gateway(client, "tiny-shakespeare")))
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=120) as http:
                body = {"model": "tiny-shakespeare", "prompt": "ROMEO:", "max_tokens": 60, "temperature": 0.0}
                whole = (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
                streamed = await http.post("/v1/completions", json=body | {"stream": True})
                text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
                               if line.startswith("data: {"))
                assert text == whole
            return whole, client._session._ring.by_ring
        finally:
            await client.close()

    text, by_ring = asyncio.run(run())
    assert text == expected
    assert by_ring > 0


def thread_states(native_id: int) -> Callable[[], str]:
    """Sample a thread's scheduler state (R, S, ...) from /proc every millisecond until
    the returned call, which gives the samples."""
    path = Path(f"/proc/self/task/{native_id}/stat")
    samples: list[str] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            samples.append(path.read_text().rsplit(")", 1)[1].split()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    def stop() -> str:
        done.set()
        sampler.join()
        return "".join(samples)

    return stop


@pytest.mark.parametrize("options", [{"reply_ring": True, "ring_spin_s": 0, "ring_pace_s": 0, "ring_first_poll_s": 0},
                                     {"ring_pace_s": 0, "ring_first_poll_s": 0}], ids=["asked", "by-default"])
def test_a_ring_client_that_does_not_spin_sleeps_until_the_daemon_wakes_it(daemon, options):
    with Client(daemon.endpoint, timeout=120, reply_ring=False) as plain:
        expected = plain.generate("ROMEO:", **LONG).token_ids
    with Client(daemon.endpoint, timeout=120, **options) as client:
        client.health()
        wait_for(lambda: client._session.ring_attached)
        delivery = client._session._ring
        by_ring = delivery.by_ring
        states = thread_states(threading.get_native_id())
        tokens = [t for chunk in client.stream("ROMEO:", **LONG) for t in chunk.token_ids]
        states = states()
        assert tokens == expected
        assert delivery.by_ring > by_ring  # woken by the daemon's bell, it found replies in the ring first
        # Between chunks it slept: a polling thread is runnable ("R") even while another runs.
        assert states.count("S") > len(states) / 2, f"{states.count('S')} of {len(states)} samples asleep"
        # A call with one reply waits on the ring the same way.
        by_ring = delivery.by_ring
        for _ in range(20):
            assert client.generate("ROMEO:", **{**LONG, "max_tokens": 2}).token_ids == expected[:2]
        assert delivery.by_ring > by_ring


def test_a_paced_stream_polls_around_the_time_each_chunk_is_due_and_loses_nothing(daemon):
    with Client(daemon.endpoint, timeout=120, reply_ring=False) as plain:
        expected = plain.generate("ROMEO:", **LONG).token_ids
    # A window wider than any gap of this host: from the third chunk on, the reader is
    # polling when each chunk lands.
    with Client(daemon.endpoint, timeout=120, ring_pace_s=MAX_RING_PACE_S) as paced, \
            Client(daemon.endpoint, timeout=120, ring_pace_s=0, ring_first_poll_s=0) as asleep:
        for client in (paced, asleep):
            client.health()
            wait_for(lambda client=client: client._session.ring_attached)
        stream = paced.stream("ROMEO:", **LONG)
        assert [t for chunk in stream for t in chunk.token_ids] == expected
        assert stream.result.token_ids == expected
        assert stream.pacer.caught > 0
        stream = asleep.stream("ROMEO:", **LONG)
        assert [t for chunk in stream for t in chunk.token_ids] == expected
        assert stream.pacer.caught == 0  # never polled: woken by the bell each time
    # The default client paces its streams and delivers the same.
    with Client(daemon.endpoint, timeout=120) as client:
        assert client.ring_pace_s == RING_PACE_S > 0 and client.ring_first_poll_s == RING_FIRST_POLL_S > 0
        assert [t for chunk in client.stream("ROMEO:", **LONG) for t in chunk.token_ids] == expected
    # Polling for the first chunk alone, for longer than it takes on this host, it finds
    # that chunk while polling (and no other: the rest are not paced).
    with Client(daemon.endpoint, timeout=120, ring_pace_s=0, ring_first_poll_s=MAX_RING_FIRST_POLL_S) as first:
        first.health()
        wait_for(lambda: first._session.ring_attached)
        stream = first.stream("ROMEO:", **LONG)
        assert [t for chunk in stream for t in chunk.token_ids] == expected
        assert stream.pacer.caught == 1


def test_a_pacer_expects_the_next_reply_after_the_median_of_recent_gaps():
    pacer = ReplyPacer(0.001)
    assert pacer.window() is None  # no reply yet
    pacer.arrived(10.0)
    assert pacer.window() is None  # one reply: no gap yet
    for t in (10.004, 10.008, 10.020, 10.024):  # gaps 4, 4, 12, 4 ms
        pacer.arrived(t)
    poll_from, poll_until = pacer.window()
    assert poll_from == pytest.approx(10.024 + 0.004 - 0.001) and poll_until == pytest.approx(10.024 + 0.004 + 0.001)
    for i in range(1, PACE_GAPS + 1):  # only the last PACE_GAPS gaps count
        pacer.arrived(10.024 + 0.010 * i)
    assert pacer.window()[0] == pytest.approx(10.024 + 0.010 * PACE_GAPS + 0.010 - 0.001)
    off = ReplyPacer(0.0)
    for t in (1.0, 1.004, 1.008):
        off.arrived(t)
    assert off.window() is None
    # The first reply: polled for from the submission; none is due between it and the second.
    first = ReplyPacer(0.001, first_s=0.02, submitted=5.0)
    assert first.window() == (5.0, 5.02)
    first.arrived(5.004)
    assert first.window() is None
    first.arrived(5.008)
    assert first.window() == pytest.approx((5.011, 5.013))
    assert ReplyPacer(0.001, first_s=0.0, submitted=5.0).window() is None


def test_many_sleeping_streams_of_one_client_are_woken_about_twice_a_step_not_once_a_reply(daemon):
    prompts = ["ROMEO:", "JULIET:", "First Citizen:", "MENENIUS:", "KING HENRY:", "To be", "O", "Now is"]
    sampling = {"max_tokens": 40, "ignore_eos": True, "temperature": 0.0}
    with Client(daemon.endpoint, timeout=120, reply_ring=False) as plain:
        expected = [plain.generate(prompt, **sampling).token_ids for prompt in prompts]
    with Client(daemon.endpoint, timeout=120, reply_ring=True, ring_spin_s=0) as client:
        client.health()
        wait_for(lambda: client._session.ring_attached)
        before = rings(daemon)
        results: list[list[int] | None] = [None] * len(prompts)
        start = threading.Barrier(len(prompts))

        def stream(i: int) -> None:
            start.wait()
            results[i] = [t for chunk in client.stream(prompts[i], **sampling) for t in chunk.token_ids]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(on_this_host(120))
        assert results == expected
        after = rings(daemon)
    written, wakes = after["written"] - before["written"], after["wakes"] - before["wakes"]
    assert written >= len(prompts) * 41  # every chunk and final went to the ring
    # Eight streams share most steps: a wake per reply would be about `written`.
    assert 0 < wakes < written / 2, (wakes, written)


def test_a_closed_session_detaches_its_ring_and_the_limit_is_enforced(daemon, capsys):
    wait_for(lambda: rings(daemon)["attached"] == 0)  # the sessions of earlier tests have ended
    with ringed_client(daemon):
        assert rings(daemon)["attached"] == 1
    wait_for(lambda: rings(daemon)["attached"] == 0)
    clients = [ringed_client(daemon) for _ in range(2)]
    try:
        for asked in (True, "auto"):
            capsys.readouterr()
            with Client(daemon.endpoint, timeout=60, reply_ring=asked) as over:
                # The daemon refuses the third ring (max_reply_rings 2); the client goes on by its socket.
                assert over.generate("ROMEO:", max_tokens=5).finish_reason == "length"
                assert not over._session.ring_attached
                stream = over.stream("ROMEO:", max_tokens=5)
                assert len([t for c in stream for t in c.token_ids]) == 5
            # Refused a ring it asked for, the client warns; refused its default one, it
            # says so at debug level only (below the default threshold).
            warned = "did not attach the reply ring" in capsys.readouterr().err
            assert warned == (asked is True), (asked, warned)
    finally:
        for client in clients:
            client.close()


def test_a_client_asks_for_a_ring_only_where_one_can_be_had():
    with pytest.raises(ValueError, match="only a daemon on this host .* not tcp://127.0.0.1:5555"):
        Client("tcp://127.0.0.1:5555", reply_ring=True)
    for size in (MIN_REPLY_RING_BYTES - 8, MAX_REPLY_RING_BYTES + 8, MIN_REPLY_RING_BYTES + 4, 1.5e6, "big", None):
        with pytest.raises(ValueError, match="reply_ring: expected 'auto', False, True or a multiple of 8 bytes"):
            Client("ipc:///nonexistent/hybridd.sock", reply_ring=size)
    # By default a client asks for a ring only where it can have one, and a client of a
    # daemon elsewhere is no error.
    with Client("ipc:///nonexistent/hybridd.sock", connect_timeout=0.1) as client:
        assert client._session._ring_bytes == DEFAULT_RING_BYTES
    for spin in (-1, MAX_RING_SPIN_S + 1, "0.1", True):
        with pytest.raises(ValueError, match="ring_spin_s: expected seconds from 0 to 10.0"):
            Client("ipc:///nonexistent/hybridd.sock", reply_ring=True, ring_spin_s=spin)
    for pace in (-0.001, MAX_RING_PACE_S * 2, "0.1", False):
        with pytest.raises(ValueError, match="ring_pace_s: expected seconds from 0 to 0.1"):
            Client("ipc:///nonexistent/hybridd.sock", ring_pace_s=pace)
        with pytest.raises(ValueError, match="ring_first_poll_s: expected seconds from 0 to 10.0"):
            Client("ipc:///nonexistent/hybridd.sock", ring_first_poll_s=pace if pace != MAX_RING_PACE_S * 2 else 11)
    with pytest.raises(ConfigError, match="max_reply_rings must be >= 0"):
        Config.from_dict({"max_reply_rings": -1})


@pytest.mark.parametrize("fields, match", [
    ({"fd": 0, "bytes": MIN_REPLY_RING_BYTES - 8}, "bytes: expected `int` >= 65536"),
    ({"fd": 0, "bytes": MAX_REPLY_RING_BYTES + 8}, "bytes: expected `int` <= 67108864"),
    ({"fd": -1, "bytes": MIN_REPLY_RING_BYTES}, "fd: expected `int` >= 0"),
    ({"fd": 999_999, "bytes": MIN_REPLY_RING_BYTES}, "fd: cannot attach the reply ring: .*No such file"),
])
def test_bad_attach_requests_get_an_error_naming_the_field(raw, daemon, fields, match):
    reply = raw.request({"type": "attach_ring", **fields})
    assert reply["type"] == "error" and reply["code"] == "invalid_request"
    assert re.search(match, reply["message"]), reply["message"]
    final, chunks = raw.generate(prompt_token_ids=[5, 6, 7], sampling={"max_tokens": 3})
    assert final["type"] == "final" and len(chunks) == 3  # the daemon serves on


def test_a_client_over_tcp_cannot_attach_a_ring(daemon, keys):
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        server_public, _ = zmq.auth.load_certificate(keys / "server.key_secret")
        public, secret = zmq.auth.load_certificate(keys / "client.key_secret")
        for option, value in ((zmq.CURVE_SERVERKEY, server_public), (zmq.CURVE_PUBLICKEY, public),
                              (zmq.CURVE_SECRETKEY, secret)):
            dealer.setsockopt(option, value)
        dealer.connect(daemon.tcp_endpoint)
        ring = RingReader(MIN_REPLY_RING_BYTES - HEADER_BYTES)
        try:
            dealer.send(codec.encode({"v": 2, "type": "attach_ring", "id": "r", "fd": ring.fd, "bytes": ring.nbytes}))
            assert dealer.poll(int(on_this_host(30) * 1000))
            reply = codec.decode(dealer.recv())
        finally:
            ring.close()
        assert reply["type"] == "error" and reply["code"] == "invalid_request" and reply["id"] == "r"
        assert "only a client on the daemon's host, connected over ipc://" in reply["message"]
    finally:
        context.destroy(linger=0)
    # The SDK over TCP asks for no ring by default and is served by its socket.
    with Client(daemon.tcp_endpoint, timeout=60, server_public_key=server_public, public_key=public,
                secret_key=secret) as client:
        assert client._session._ring_bytes is None
        assert client.generate("ROMEO:", max_tokens=3).finish_reason == "length"


def test_a_ring_that_is_not_sealed_or_not_a_ring_is_refused(raw, daemon):
    unsealed = RingReader(MIN_REPLY_RING_BYTES - HEADER_BYTES, seals=0)
    try:
        reply = raw.request({"type": "attach_ring", "fd": unsealed.fd, "bytes": unsealed.nbytes})
        assert reply["code"] == "invalid_request" and reply["field"] == "fd"
        assert "not a memfd sealed against shrinking" in reply["message"]
    finally:
        unsealed.close()
    ring = RingReader(MIN_REPLY_RING_BYTES - HEADER_BYTES)
    try:
        reply = raw.request({"type": "attach_ring", "fd": ring.fd, "bytes": ring.nbytes + 8})
        assert reply["code"] == "invalid_request" and "the request says" in reply["message"]
        assert raw.request({"type": "attach_ring", "fd": ring.fd, "bytes": ring.nbytes})["type"] == "ring_attached"
        again = RingReader(MIN_REPLY_RING_BYTES - HEADER_BYTES)
        try:
            reply = raw.request({"type": "attach_ring", "fd": again.fd, "bytes": again.nbytes})
            assert reply["code"] == "invalid_request" and "has a reply ring already" in reply["message"]
        finally:
            again.close()
    finally:
        ring.close()


def test_a_ring_nobody_reads_leaves_replies_to_the_socket_and_a_hostile_one_is_detached(raw, daemon):
    ring = RingReader(MIN_REPLY_RING_BYTES - HEADER_BYTES)
    try:
        assert raw.request({"type": "attach_ring", "fd": ring.fd, "bytes": ring.nbytes})["type"] == "ring_attached"
        before = rings(daemon)
        # Logprobs make each chunk large: the 64 KiB ring fills and the socket carries the rest.
        final, chunks = raw.generate(prompt_token_ids=[5, 6, 7], timeout=120,
                                     sampling={"max_tokens": 300, "ignore_eos": True, "logprobs": True,
                                               "top_logprobs": 20})
        assert final["type"] == "final" and len(chunks) == 300
        after = rings(daemon)
        assert after["left_out"] > before["left_out"]
        records = drain(ring)
        numbers = [n for n, _ in records]
        # A reply the full ring had no room for is skipped; a smaller later one may still fit.
        assert numbers and numbers[0] == 1 and numbers == sorted(set(numbers))
        assert len(numbers) < len(chunks)
        for number, payload in records:  # each copy in the ring is the socket's reply of that number
            assert codec.decode(payload) == chunks[number - 1]
        # A read position the daemon never gave: the ring is detached, the session goes on.
        ring._ring.read_pos.value = 1 << 40
        attached = rings(daemon)["attached"]
        final, chunks = raw.generate(prompt_token_ids=[5, 6, 7], sampling={"max_tokens": 4})
        assert final["type"] == "final" and len(chunks) == 4
        wait_for(lambda: rings(daemon)["attached"] == attached - 1)
    finally:
        ring.close()
