"""Requests ended before their time: cancel, timeout, the end of a client's session,
drain, and the engine's death.

A request ends wherever it is: waiting for its prompt's tokens (`Admission`), or run by
the engine core, whose unfinished sequences stop and free their KV blocks. A cancelled,
timed-out or drained request's final reply goes out at once; a request whose session
ended gets no reply (nobody reads it); when the engine dies or shuts down, every
request still in flight is answered with a terminal error.
"""

from __future__ import annotations

import time

from hybridd.engine.core import EngineCore
from hybridd.protocol.errors import ErrorCode
from hybridd.workers.admission import Admission
from hybridd.workers.client_requests import request_key
from hybridd.workers.replies import Replies


class RequestEndings:
    """Ends client requests early, waiting (in admission) or running (in the core)."""

    def __init__(self, core: EngineCore, admission: Admission, replies: Replies) -> None:
        self.core = core
        self.admission = admission
        self.replies = replies

    def cancel(self, identity: bytes, target: str) -> None:
        self.end(request_key(identity, target), "cancelled")

    def end(self, key: str, reason: str) -> None:
        """Stop every unfinished sequence of a request (cancel, drain); its final goes out now."""
        if key in self.admission:
            self.admission.end(key, reason)
            return
        if self.core.abort(key, reason) is not None:
            self.replies.deliver(self.core.take_outputs())

    def expire(self, now: float) -> None:
        """End the requests whose deadline has passed, waiting or running."""
        self.admission.expire(now)
        self.core.expire(now)
        self.replies.deliver(self.core.take_outputs())

    def end_session(self, identity: bytes) -> None:
        """The client is gone: its requests are cancelled, their KV blocks freed; no reply."""
        self.admission.end_session(identity)
        self.replies.end_session(identity)

    def drained(self, deadline: float) -> bool:
        """While draining: whether the drain is over, every request ended and its replies
        handed to the transport, or the deadline passed (what is left is cancelled then);
        once it is, the core waits for its steps in flight and drops their tokens."""
        requests = self.replies.requests
        if (requests or self.admission.pending or self.replies.pending) and time.monotonic() < deadline:
            return False
        for key in list(requests) + list(self.admission.pending):
            self.end(key, "cancelled")
        self.core.drain()
        return True

    def fail_all(self, code: ErrorCode, message: str) -> None:
        """A terminal error for every request still in flight (engine death, shutdown)."""
        self.replies.fail_all(code, message)
        self.admission.fail_all(code, message)
        self.replies.flush()
