"""The sync face of the client core: `Client` and its `Stream`.

The session runs in a private event loop in a background thread (the only thread that
touches the socket, as ZeroMQ requires); callers' threads hand requests over with
`call_soon_threadsafe` and wait for replies themselves, on the reply ring when the
daemon attached one (woken by the daemon itself) or on their own queue, so any number
of threads can share one `Client`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from hybridd.client.core import (
    Call, ClientCore, Messages, Sampling, Timeout, Tools, generated, health_of, reach, remaining,
    status_of,
)
from hybridd.client.session import Session, seconds
from hybridd.client_ring import (
    MAX_RING_FIRST_POLL_S, MAX_RING_PACE_S, MAX_RING_SPIN_S, RING_FIRST_POLL_S, RING_PACE_S,
    RING_SLEEP_S, RING_SPIN_S, ReplyPacer,
)
from hybridd.errors import DaemonUnreachableError, RequestTimeoutError, UnavailableError
from hybridd.ipc.reply_ring import RingBroken
from hybridd.protocol.messages import Reply
from hybridd.results import Chunk, GenerateResult, Health

# wait_ready(): how often it asks, and how long each question may take.
_READY_POLL_S = 0.2
_READY_POLL_TIMEOUT_S = 2.0


class _LoopThread:
    """A private event loop in a daemon thread; the home of one `Session`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hybridd-client-io", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` in the loop thread and return its result (or raise its exception)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001  handed to the calling thread
                future.set_exception(error)

        self.loop.call_soon_threadsafe(run)
        return future.result()

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def _close_sync(io: _LoopThread, session: Session) -> None:
    with contextlib.suppress(RuntimeError):
        io.run(session.close())
    io.stop()


def _wait_ring(client: Client, replies: queue.SimpleQueue, deadline: float | None,
               pacer: ReplyPacer | None = None) -> Reply | None:
    """The next reply in `replies` by way of the session's reply ring: polled for the
    client's `ring_spin_s`, and polled again in the `pacer`'s window around the time the
    reply is due; slept for on the ring's bell otherwise, which the daemon rings after
    writing records and the session after a reply only the socket brought. None when the
    session has no ring (any more) or the deadline passed."""
    session = client._session
    reader = session.ring_reader()
    if reader is None:
        return None
    spin_until = time.monotonic() + client.ring_spin_s
    poll_from, poll_until = (pacer.window() if pacer is not None else None) or (0.0, 0.0)
    polling = False
    try:
        with reader.sleeping():
            while not reader.closing:
                bell = reader.bell()  # before looking: a record written after it changes it
                session.poll_ring()
                if not replies.empty():
                    if polling and pacer is not None and poll_from <= time.monotonic():
                        pacer.caught += 1
                    return replies.get_nowait()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return None
                if now < spin_until or poll_from <= now < poll_until:
                    polling = True
                    os.sched_yield()  # lets the client's I/O thread run; no sleep
                    continue
                polling = False
                sleep = RING_SLEEP_S if deadline is None else min(RING_SLEEP_S, deadline - now)
                if now < poll_from:
                    sleep = min(sleep, poll_from - now)
                reader.sleep(bell, sleep)
    except RingBroken:
        pass  # closed before this thread came to sleep on it
    return None


class Stream:
    """Chunks of one streaming `generate`, as they arrive; `result` once it ended.

    Closing it (or dropping it: garbage collection) before the end cancels the request.
    """

    def __init__(self, client: Client, call: Call, *, paced: bool = True) -> None:
        self.id = call.id
        self._call = call
        self._client = client
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pacer = ReplyPacer(client.ring_pace_s, client.ring_first_poll_s, time.monotonic()) if paced else None
        client._io.run(reach(client._session, call))
        if not call.done:  # not answered by the fallback endpoint
            client._io.call(client._session.submit, call.request, self._queue.put)
            call.sent = True

    @property
    def result(self) -> GenerateResult | None:
        return self._call.result

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        call = self._call
        if call.done:
            raise StopIteration
        reply = _wait_ring(self._client, self._queue, call.deadline, self.pacer)
        if reply is None:
            try:
                reply = self._queue.get(timeout=remaining(call.deadline))
            except queue.Empty:
                self._client._io.post(self._client._session.abandon, self.id)
                raise call.expired() from None
        if self.pacer is not None:
            self.pacer.arrived(time.monotonic())
        chunk = call.take(reply)
        if chunk is None:
            raise StopIteration
        return chunk

    def close(self) -> None:
        if self._call.stop():
            self._client._io.post(self._client._session.abandon, self.id)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _seconds_up_to(value: float, most: float, name: str) -> float:
    """A number of seconds from 0 to `most`, as a float; ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= most:
        raise ValueError(f"{name}: expected seconds from 0 to {most}, got {value!r}")
    return float(value)


class Client(ClientCore):
    """A thread-safe client for one daemon. Use as a context manager, or call `close()`.

    A client of a daemon on this host (an ipc:// endpoint, x86-64) asks it, by default
    (`reply_ring="auto"`), to write the session's replies into shared memory as well as
    on the socket (ipc/reply_ring.py): a thread waiting for a reply (iterating a
    `Stream`, or in a call with one answer) sleeps on that memory until the daemon
    itself wakes it after writing the reply, so the reply arrives
    without the socket's I/O threads and the client's event loop in between. With
    `ring_spin_s` > 0 the thread first polls the memory for that long (keeping a CPU
    busy). A stream's thread also wakes by itself `ring_pace_s` before its next chunk is
    due (by the stream's recent gaps) and polls until that long after, so that the chunk
    finds it awake (0: asleep until woken); for its first chunk it polls from the
    request's submission for up to `ring_first_poll_s` (0: not at all). Where the
    daemon cannot attach the ring (another user, a limit), replies come
    by the socket alone, and the client's log says why: a debug line, or a warning where
    the caller asked for the ring (`reply_ring=True` or a size in bytes, which a client
    of a daemon elsewhere cannot have). `reply_ring=False` asks for none.
    """

    def __init__(self, endpoint: str | None = None, *, ring_spin_s: float = RING_SPIN_S,
                 ring_pace_s: float = RING_PACE_S, ring_first_poll_s: float = RING_FIRST_POLL_S,
                 **options: Any) -> None:
        """`options`: timeout, connect_timeout, the CURVE keys and reply_ring (`ClientCore`)."""
        super().__init__(endpoint, **options)
        self.ring_spin_s = _seconds_up_to(ring_spin_s, MAX_RING_SPIN_S, "ring_spin_s")
        self.ring_pace_s = _seconds_up_to(ring_pace_s, MAX_RING_PACE_S, "ring_pace_s")
        self.ring_first_poll_s = _seconds_up_to(ring_first_poll_s, MAX_RING_FIRST_POLL_S, "ring_first_poll_s")
        self._io = _LoopThread()
        try:
            self._session: Session = self._io.call(self._new_session_here)
        except BaseException:
            self._io.stop()
            raise
        self._finalizer = weakref.finalize(self, _close_sync, self._io, self._session)

    def _new_session_here(self) -> Session:
        return self._new_session(wake_loop=False)  # its waiters are threads that wait on the ring themselves

    def _complete(self, call: Call) -> Call:
        """Run a call with one answer to its end."""
        for _ in Stream(self, call, paced=False):
            pass
        return call

    def generate(self, prompt: str | list[int], sampling: Sampling = None, *, request_id: str | None = None,
                 timeout: Timeout = ..., connect_timeout: float | None = None, cache_salt: str | None = None,
                 speculative: bool | None = None, **sampling_options: Any) -> GenerateResult:
        """Run one completion and return it whole. Sampling options as keywords or `sampling`;
        `cache_salt`: requests share prefix-cache blocks only under the same salt; `speculative`:
        False turns speculative decoding off for this request (None: the daemon's setting)."""
        return generated(self._complete(self._generate_call(
            prompt, None, sampling, sampling_options, request_id, timeout, connect_timeout, stream=False,
            cache_salt=cache_salt, speculative=speculative)))

    def stream(self, prompt: str | list[int], sampling: Sampling = None, *, request_id: str | None = None,
               timeout: Timeout = ..., connect_timeout: float | None = None, cache_salt: str | None = None,
               speculative: bool | None = None, **sampling_options: Any) -> Stream:
        """Start one completion; iterate the returned `Stream` for its chunks."""
        return Stream(self, self._generate_call(prompt, None, sampling, sampling_options, request_id, timeout,
                                                connect_timeout, stream=True, cache_salt=cache_salt,
                                                speculative=speculative))

    def chat(self, messages: Messages, sampling: Sampling = None, *, request_id: str | None = None,
             timeout: Timeout = ..., connect_timeout: float | None = None, cache_salt: str | None = None,
             tools: Tools | None = None,
                   speculative: bool | None = None, **sampling_options: Any) -> GenerateResult:
        """The model's answer to a chat (`[{"role": "user", "content": "..."}]`), rendered by
        its chat template in the daemon, returned whole. `tools`: the functions the model
        may call (`ToolSpec`s or maps of their fields), written into the prompt by the
        template; structured output is a sampling option (`structured=StructuredOutput(...)`)."""
        return generated(self._complete(self._generate_call(
            None, messages, sampling, sampling_options, request_id, timeout, connect_timeout, stream=False,
            cache_salt=cache_salt, tools=tools, speculative=speculative)))

    def chat_stream(self, messages: Messages, sampling: Sampling = None, *, request_id: str | None = None,
                    timeout: Timeout = ..., connect_timeout: float | None = None, cache_salt: str | None = None,
                    tools: Tools | None = None,
                   speculative: bool | None = None, **sampling_options: Any) -> Stream:
        """Start the model's answer to a chat; iterate the returned `Stream` for its chunks."""
        return Stream(self, self._generate_call(None, messages, sampling, sampling_options, request_id, timeout,
                                                connect_timeout, stream=True, cache_salt=cache_salt,
                                                tools=tools, speculative=speculative))

    def cancel(self, request_id: str) -> None:
        """Cancel a request of this client; idempotent, no-op for an unknown or finished id."""
        self._io.call(self._session.cancel, request_id)

    def status(self, *, timeout: Timeout = ..., connect_timeout: float | None = None) -> dict[str, Any]:
        return status_of(self._complete(self._status_call(timeout, connect_timeout)))

    def health(self, *, timeout: Timeout = ..., connect_timeout: float | None = None) -> Health:
        return health_of(self._complete(self._health_call(timeout, connect_timeout)))

    def wait_ready(self, timeout: float) -> Health:
        """Block until the daemon serves (health `ok`), at most `timeout` seconds; then
        UnavailableError naming the last state seen (through the fallback endpoint while
        the daemon starts or restarts its workers)."""
        deadline = time.monotonic() + timeout
        seen = "no answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise UnavailableError(f"the daemon at {self.endpoint} was not ready within {seconds(timeout)} s "
                                       f"(last seen: {seen})")
            try:
                health = self.health(timeout=min(left, _READY_POLL_TIMEOUT_S),
                                     connect_timeout=min(left, _READY_POLL_TIMEOUT_S))
                if health.ok:
                    return health
                seen = health.state
            except (DaemonUnreachableError, RequestTimeoutError) as error:
                seen = str(error)
            time.sleep(min(_READY_POLL_S, max(0.0, deadline - time.monotonic())))

    @property
    def connected(self) -> bool:
        return self._session.connected

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
