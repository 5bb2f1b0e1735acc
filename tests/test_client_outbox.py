"""The SDK's session writes its socket without blocking the event loop: what the socket
cannot take yet (past its high-water mark, while the daemon does not read) waits in the
session's outbox, in order, and goes out once the daemon reads again — all from the
loop's callback on the socket's descriptor, with a real ROUTER as the daemon."""

from __future__ import annotations

import asyncio
import threading

import zmq

from hybridd import AsyncClient
from hybridd.protocol.codec import REQUESTS
from hybridd.protocol.messages import CancelRequest

# Enough small messages to fill the DEALER's queue (its high-water mark is 1000), the
# kernel's socket buffer and the ROUTER's queue.
BURST = 20_000


def test_a_burst_past_the_high_water_mark_waits_in_order_and_reaches_a_daemon_that_reads_later(tmp_path):
    endpoint = f"ipc://{tmp_path}/d.sock"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 10)
    router.bind(endpoint)
    start_reading = threading.Event()
    targets: list[str] = []

    def daemon() -> None:
        start_reading.wait()
        while len(targets) < BURST and router.poll(10_000):
            _, frame = router.recv_multipart()
            request = REQUESTS.decode(frame)
            assert isinstance(request, CancelRequest)
            targets.append(request.target)

    reader = threading.Thread(target=daemon)
    reader.start()

    async def main() -> None:
        async with AsyncClient(endpoint) as client:
            for i in range(BURST):
                await client.cancel(f"r{i}")
            session = client._session
            assert session is not None
            assert session._outbox, "the burst fit the socket: this test no longer reaches the outbox"
            start_reading.set()
            while session._outbox:  # flushed from the descriptor's callback as the daemon reads
                await asyncio.sleep(0.01)
            await asyncio.to_thread(reader.join, 60)

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        start_reading.set()
        reader.join(10)
        router.close(linger=0)
        context.term()
    assert targets == [f"r{i}" for i in range(BURST)]
