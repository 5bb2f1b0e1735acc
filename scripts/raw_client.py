"""A raw protocol client for the tools (protocol/SPEC.md): one DEALER, msgpack frames
through the daemon's own codec, no SDK between the caller and the socket."""

from __future__ import annotations

import time
import uuid

import zmq

from hybridd.protocol import codec


class RawClient:
    def __init__(self, context: zmq.Context, endpoint: str, version: int = 1):
        self.version = version
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.inbox: dict[str, list[dict]] = {}  # replies received while waiting for another id

    def send(self, message: dict) -> str:
        message = {"v": self.version, "id": uuid.uuid4().hex, **message}
        self.socket.send(codec.encode(message))
        return message["id"]

    def recv(self, timeout: float = 30.0, spin: bool = False) -> dict | None:
        """The next reply, or None after `timeout` s. `spin`: poll without sleeping (a core
        busy meanwhile), so the reply is taken the moment it arrives, not when the OS wakes
        this thread."""
        if spin:
            deadline = time.monotonic() + timeout
            while not self.socket.poll(0):
                if time.monotonic() > deadline:
                    return None
            return codec.decode(self.socket.recv())
        if self.socket.poll(int(timeout * 1000)):
            return codec.decode(self.socket.recv())
        return None

    def request(self, message: dict, timeout: float = 30.0) -> dict | None:
        """One request's reply (others received meanwhile are kept for their ids)."""
        rid = self.send(message)
        queued = self.inbox.get(rid)
        if queued:
            return queued.pop(0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self.recv(max(0.0, deadline - time.monotonic()))
            if reply is None:
                return None
            if reply.get("id") == rid:
                return reply
            self.inbox.setdefault(reply.get("id"), []).append(reply)
        return None

    def close(self) -> None:
        self.socket.close(0)
