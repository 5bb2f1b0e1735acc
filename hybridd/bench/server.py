"""The daemon under test and its client: `hybridd start` on the bench's settings
(HybriddServer, start_server, its start split by lifecycle phase), the compile caches a
first start finds empty, and the SDK as a user gets it (SdkClient), at which every hybridd
figure is taken.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybridd import environment
from hybridd.bench.daemon import Daemon
from hybridd.bench.timing import StreamRecord, concurrent_streams, timed_stream


class SdkClient:
    """The SDK as a user gets it: `hybridd.Client.stream()` for one stream (its default
    reply path), `hybridd.AsyncClient` (one event loop, no threads) for concurrent streams.
    Every hybridd figure is taken at this client."""

    first_record: StreamRecord | None = None  # the first request it made, if any

    def __init__(self, endpoint: str):
        from hybridd.client import Client

        self.endpoint = endpoint
        self._client = Client(endpoint, timeout=60.0)
        self._client.health()  # a ring is attached on connecting; its answer comes first
        path = "replies by the reply ring" if self._client._session.ring_attached else "replies by its socket alone"
        self.kind = f"sdk (hybridd.Client.stream: {path}; AsyncClient.stream for concurrent streams)"

    def stream(self, prompt, max_tokens, timeout=300.0) -> StreamRecord:
        return self.stream_tokens(prompt, max_tokens, timeout)[0]

    def stream_tokens(self, prompt, max_tokens, timeout=300.0) -> tuple[StreamRecord, list[int]]:
        return timed_stream(self._client, prompt, max_tokens, timeout)

    def ttft(self, ids: list[int], max_tokens: int) -> float:
        record = self.stream(ids, max_tokens)
        if record.ttft is None:
            raise RuntimeError("hybridd streamed no token")
        return record.ttft

    def gaps(self, ids: list[int], max_tokens: int) -> list[float]:
        record = self.stream(ids, max_tokens)
        if record.tokens != max_tokens:
            raise RuntimeError(f"hybridd streamed {record.tokens} tokens, expected {max_tokens}")
        return record.gaps

    def streams(self, prompts, max_tokens, timeout=300.0) -> list[StreamRecord]:
        return concurrent_streams(self.endpoint, prompts, max_tokens, timeout)

    def status(self):
        return self._client.status(timeout=10)

    def close(self):
        self._client.close()


def open_client(endpoint: str) -> SdkClient:
    """The SDK, its first request (a 2-token stream) kept as `first_record`."""
    client = SdkClient(endpoint)
    try:
        client.first_record = client.stream([5, 6, 7], 2, timeout=120)
    except BaseException:
        client.close()
        raise
    return client


def compile_cache_entries() -> dict[str, int]:
    """Files in the on-disk Triton and Inductor caches (where the workers will look): a
    start with empty caches compiles every kernel and sampling path, later starts load them."""
    import getpass

    dirs = {
        "triton": environment.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache"),
        "inductor": environment.get("TORCHINDUCTOR_CACHE_DIR")
        or os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"),
    }
    return {name: sum(len(files) for _, _, files in os.walk(d)) for name, d in dirs.items()}


COMPILE_CACHE_VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def on_empty_compile_caches(fn):
    """fn() with Triton's and Inductor's caches in a new directory (removed afterwards), as
    the workers spawned meanwhile will find them: a start there is a first start on the
    host (it compiles every kernel)."""
    with tempfile.TemporaryDirectory(prefix="hybridd-caches-", ignore_cleanup_errors=True) as root:
        previous = environment.export({name: f"{root}/{name.lower()}" for name in COMPILE_CACHE_VARS})
        try:
            return fn()
        finally:
            environment.restore(previous)


class HybriddServer(Daemon):
    """The real daemon (`hybridd start`) on `model` with `overrides` as its settings; its
    start split by the lifecycle phases its log records (logged at info)."""

    def __init__(self, model: Path, device: str, ready_timeout: float, **overrides):
        self.compile_caches_at_spawn = compile_cache_entries()
        super().__init__({"model": str(model), "device": device, **overrides, "log_level": "info"}, ready_timeout)
        self.health_ok = self.ready
        self.events = self.phases()

    def first(self, worker: str, phase: str) -> float | None:
        """When `worker` first reported `phase`, on this process's perf_counter clock."""
        return next((self.spawned + t for t, w, p, _ in self.events if w == worker and p == phase), None)

    def startup(self) -> dict[str, Any]:
        t0 = self.spawned
        loading, capturing = self.first("graph", "loading"), self.first("graph", "capturing")
        ready = self.first("context", "ready") or self.health_ok

        def since(t: float | None, origin: float | None) -> float | None:
            return t - origin if t is not None and origin is not None else None

        return {
            "spawn_to_ready_s": ready - t0,
            "spawn_to_health_ok_s": self.health_ok - t0,
            "interpreter_and_imports_s": since(loading, t0),
            "weights_load_s": since(capturing, loading),  # weights, KV arena and buffers allocated
            "after_weights_to_ready_s": since(ready, capturing),  # decode capture + handshake
            "compile_cache_files_at_spawn": self.compile_caches_at_spawn,
            "phases": [{"t_s": t, "worker": w, "phase": p, "detail": d} for t, w, p, d in self.events],
        }


def server_overrides(args, graphs: bool = True) -> dict[str, Any]:
    """The daemon's settings for every hybridd part: its defaults, less KV cache on CUDA
    (the peers share the device)."""
    cuda = args.device == "cuda"
    overrides: dict[str, Any] = {"use_cuda_graphs": graphs, "compile_sampler": cuda, "log_level": "warning"}
    if cuda:
        overrides["kv_cache_memory_fraction"] = 0.3
    return overrides


def start_server(args, model: Path, graphs: bool = True, **overrides) -> HybriddServer:
    """The daemon on `model` with the bench's settings and `overrides`."""
    return HybriddServer(model, args.device, 600 if args.device == "cuda" else 120,
                         **{**server_overrides(args, graphs), **overrides})


@contextlib.contextmanager
def sdk_on_server(args, model: Path, result: dict, graphs: bool = True,
                  **overrides) -> Iterator[tuple[HybriddServer, SdkClient]]:
    """A daemon (start_server) and the SDK on it; its settings, start and client in `result`."""
    server, client = start_server(args, model, graphs, **overrides), None
    try:
        result["config"] = {k: v for k, v in {**server_overrides(args, graphs), **overrides}.items()
                            if k != "log_level"}
        result["startup"] = server.startup()
        client = open_client(server.endpoint)
        result["client"] = client.kind
        yield server, client
    finally:
        if client is not None:
            client.close()
        server.close()
