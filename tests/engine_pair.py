"""Start the two worker processes directly (no supervisor) and talk to them over a real
DEALER socket speaking the wire protocol: the harness of the decoupled-runtime tests."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from pathlib import Path
from unittest import mock

import zmq

from hybridd.config import Config
from hybridd.cuda_mps import start_for
from hybridd.protocol import codec
from tests.host_load import on_this_host


class EnginePair:
    def __init__(self, runtime_dir: Path, context_target=None, **overrides):
        values = {"runtime_dir": str(runtime_dir), "compile_sampler": False, "log_level": "warning"}
        values.update(overrides)
        self.config = Config.from_dict(values)
        # The MPS daemon the supervisor would start (cuda_mps, "auto" by default: CUDA
        # devices only); the workers inherit its directories at spawn.
        self.mps, _ = start_for(self.config.cuda_mps, self.config.device, Path(runtime_dir))
        ctx = mp.get_context("spawn")
        ctl = f"ipc://{runtime_dir}/ctl-test.sock"
        from hybridd.workers import context_generator, graph_generator

        # No supervisor calls this pair ready: the context generator's own state says it.
        # Not daemonic, as the supervisor spawns them: the graph generator starts processes
        # of its own (its kernel compile pool); close() ends both.
        self.context = ctx.Process(target=context_target or context_generator.main,
                                   args=(self.config.to_dict(), ctl, False), daemon=False)
        self.graph = ctx.Process(target=graph_generator.main, args=(self.config.to_dict(), ctl), daemon=False)
        try:
            with mock.patch.dict(os.environ, self.mps.env if self.mps else {}):
                self.context.start()
                self.graph.start()
        except BaseException:
            if self.mps is not None:
                self.mps.stop()
            raise
        self.zmq = zmq.Context()

    def client(self, version: int = 1) -> Client:
        return Client(self.zmq, self.config.client_endpoint, version)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the pair serves: `timeout` seconds as on an idle host, stretched by the
        host's load (two workers importing torch and loading a model share its cores)."""
        client = self.client()
        deadline = time.monotonic() + on_this_host(timeout)
        try:
            while time.monotonic() < deadline:
                if not (self.context.is_alive() and self.graph.is_alive()):
                    raise RuntimeError("a worker died during start-up")
                reply = client.request({"type": "health"}, timeout=0.5)
                if reply is not None and reply.get("ok"):
                    return
            raise TimeoutError("engine pair not ready")
        finally:
            client.close()

    def __enter__(self) -> EnginePair:
        """The pair once it serves (closed if it never does)."""
        try:
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for proc in (self.context, self.graph):
            if proc.is_alive():
                proc.terminate()
        for proc in (self.context, self.graph):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self.zmq.term()
        if self.mps is not None:
            self.mps.stop()


class Client:
    """A raw protocol client: one DEALER, msgpack frames, speaking protocol `version`
    (version 1 by default: the shapes most tests read)."""

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

    def send_raw(self, frame: bytes) -> None:
        self.socket.send(frame)

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

    def _next_for(self, rid: str, deadline: float) -> dict | None:
        queued = self.inbox.get(rid)
        if queued:
            return queued.pop(0)
        while time.monotonic() < deadline:
            reply = self.recv(max(0.0, deadline - time.monotonic()))
            if reply is None:
                return None
            if reply.get("id") == rid:
                return reply
            self.inbox.setdefault(reply.get("id"), []).append(reply)
        return None

    def request(self, message: dict, timeout: float = 30.0) -> dict | None:
        rid = self.send(message)
        return self._next_for(rid, time.monotonic() + timeout)

    def generate(self, timeout: float = 60.0, **fields) -> tuple[dict, list[dict]]:
        """Send a generate request; return (final or error reply, chunks)."""
        rid = self.send({"type": "generate", **fields})
        return self.collect(rid, timeout)

    def collect(self, rid: str, timeout: float = 60.0) -> tuple[dict, list[dict]]:
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self._next_for(rid, deadline)
            if reply is None:
                break
            if reply["type"] == "chunk":
                chunks.append(reply)
            else:
                return reply, chunks
        raise TimeoutError(f"no final reply for {rid}")

    def close(self) -> None:
        self.socket.close()
