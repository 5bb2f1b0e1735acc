"""What the HTTP gateway adds at the client (the bench's `hybridd` part): TTFT and ITL
p50 of the same greedy requests streamed through the OpenAI-compatible gateway
(`/v1/completions`, SSE) and through the SDK, interleaved in one run against one
daemon. The SDK side takes its replies by its socket alone (`reply_ring=False`), as the
gateway's own client of the daemon does: the difference is the HTTP layer's.

The gateway runs as its own process (`python -m hybridd.gateway.process`), as under the
supervisor. Both sides count the same events: the first reply of a request for TTFT,
and replies that carry text for ITL (the gateway sends no event for a chunk whose text
is still held back, so the SDK side skips those too). The HTTP side is timed with a
lean client (h11 over one kept-alive TCP socket): the request leaves in one write, and
an event's time is that of the `recv` that brought its last byte, so the figure is what
the gateway adds, not what a client library spends.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybridd.bench.daemon import stop

READY_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class SSEConnection:
    """One kept-alive HTTP/1.1 connection (h11 over a TCP_NODELAY socket) that streams
    server-sent events and stamps each with the time its last byte was received."""

    def __init__(self, host: str, port: int) -> None:
        import h11

        self._h11 = h11
        self.host = f"{host}:{port}"
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h11.Connection(h11.CLIENT)

    def post(self, path: str, body: dict[str, Any]) -> tuple[float, Iterator[tuple[float, bytes]]]:
        """Send `body` (one write); returns the send time and the events as (time, payload)."""
        h11 = self._h11
        data = json.dumps(body).encode()
        request = h11.Request(method="POST", target=path, headers=[
            ("Host", self.host), ("Content-Type", "application/json"), ("Accept", "text/event-stream"),
            ("Content-Length", str(len(data))),
        ])
        wire = self.conn.send(request) + self.conn.send(h11.Data(data=data)) + self.conn.send(h11.EndOfMessage())
        sent = time.perf_counter()
        self.sock.sendall(wire)
        return sent, self._events()

    def _events(self) -> Iterator[tuple[float, bytes]]:
        h11 = self._h11
        buffer, received = b"", 0.0
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                chunk = self.sock.recv(65536)
                received = time.perf_counter()
                if not chunk:
                    raise ConnectionError("the gateway closed the connection mid-response")
                self.conn.receive_data(chunk)
            elif isinstance(event, h11.Response):
                if event.status_code != 200:
                    raise RuntimeError(f"gateway answered HTTP {event.status_code}")
            elif isinstance(event, h11.Data):
                buffer += event.data
                while b"\n\n" in buffer:
                    line, buffer = buffer.split(b"\n\n", 1)
                    yield received, line
            elif isinstance(event, h11.EndOfMessage):
                self.conn.start_next_cycle()
                return
            else:
                raise RuntimeError(f"unexpected HTTP event {event!r}")

    def close(self) -> None:
        self.sock.close()


def _text_events(events: Iterator[tuple[float, bytes]]) -> Iterator[tuple[float, bool]]:
    """(arrival time, carries text) of each completion event; raises on an error event."""
    for at, line in events:
        if not line.startswith(b"data: {"):
            continue
        payload = json.loads(line[6:])
        if "error" in payload:
            raise RuntimeError(f"gateway error: {payload['error']}")
        yield at, bool(payload["choices"] and payload["choices"][0]["text"])


class Gateway:
    """The gateway process on a free loopback port, against `endpoint`."""

    def __init__(self, endpoint: str, model: str) -> None:
        self.port = _free_port()
        self.process = subprocess.Popen([
            sys.executable, "-m", "hybridd.gateway.process", "--endpoint", endpoint,
            "--http-endpoint", f"127.0.0.1:{self.port}", "--model", model, "--log-level", "warning",
        ])
        self.model = Path(model).name
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.process.returncode}")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the gateway was not healthy within {READY_TIMEOUT_S} s")
            time.sleep(0.1)
        self.sse = SSEConnection("127.0.0.1", self.port)

    def _healthy(self) -> bool:
        try:
            # No proxy: the environment's would be asked for a loopback address.
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(f"http://127.0.0.1:{self.port}/health", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def stream(self, ids: list[int], max_tokens: int) -> tuple[float, list[float]]:
        """(TTFT, arrival times of the events that carry text) of one streamed completion,
        read with the lean client."""
        sent, events = self.sse.post("/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": max_tokens,
                                                         "temperature": 0, "stream": True, "ignore_eos": True})
        first, times = None, []
        for at, text in _text_events(events):
            first = first or at
            if text:
                times.append(at)
        if first is None:
            raise RuntimeError("the gateway streamed no event")
        return first - sent, times

    def close(self) -> None:
        if hasattr(self, "sse"):
            self.sse.close()
        stop(self.process, 20)


def _sdk_stream(client: Any, ids: list[int], max_tokens: int) -> tuple[float, list[float]]:
    sent = time.perf_counter()
    first, times = None, []
    stream = client.stream(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for chunk in stream:
        now = time.perf_counter()
        first = first or now
        if chunk.text:
            times.append(now)
    return (first or time.perf_counter()) - sent, times


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def measure_gateway(endpoint: str, model: str, *, prompt_len: int, ttft_reps: int, itl_tokens: int, itl_runs: int,
                    vocab: int, rng: random.Random) -> dict[str, Any]:
    """TTFT and ITL p50 through HTTP and through the SDK, interleaved (the order
    alternating), and what HTTP adds."""
    from hybridd.client import Client

    gateway = Gateway(endpoint, model)
    try:
        with Client(endpoint, timeout=300.0, reply_ring=False) as sdk:
            prompt = lambda: [rng.randrange(3, vocab) for _ in range(prompt_len)]  # noqa: E731
            ttft_fns = {"sdk": lambda ids: _sdk_stream(sdk, ids, 1)[0], "http": lambda ids: gateway.stream(ids, 1)[0]}
            itl_fns = {"sdk": lambda ids: _sdk_stream(sdk, ids, itl_tokens)[1],
                       "http": lambda ids: gateway.stream(ids, itl_tokens)[1]}
            for fn in ttft_fns.values():  # warm-up
                fn(prompt())
            ttft: dict[str, list[float]] = {side: [] for side in ttft_fns}
            gaps: dict[str, list[float]] = {side: [] for side in itl_fns}
            for rep in range(ttft_reps):
                ids = prompt()
                order = list(ttft_fns) if rep % 2 == 0 else list(reversed(ttft_fns))
                for side in order:
                    ttft[side].append(ttft_fns[side](ids))
            for run in range(itl_runs):
                ids = prompt()
                for side in (("sdk", "http") if run % 2 == 0 else ("http", "sdk")):
                    gaps[side].extend(_gaps(itl_fns[side](ids)))
    finally:
        gateway.close()
    out: dict[str, Any] = {"prompt_tokens": prompt_len, "itl_tokens": itl_tokens,
                           "http_client": "h11 on a TCP_NODELAY socket; an event's time is its last byte's recv"}
    for side in ("sdk", "http"):
        out[side] = {"ttft_p50_s": _p50(ttft[side]), "itl_p50_s": _p50(gaps[side]), "ttft_n": len(ttft[side]),
                     "itl_n": len(gaps[side])}
    for key in ("ttft_p50_s", "itl_p50_s"):
        http, sdk_value = out["http"][key], out["sdk"][key]
        out[f"added_{key}"] = http - sdk_value if http is not None and sdk_value is not None else None
    # The median of the per-prompt differences (the two sides ran back to back on the same
    # prompt): steadier than the difference of the medians where TTFT itself varies.
    out["added_ttft_paired_p50_s"] = _p50([h - s for h, s in zip(ttft["http"], ttft["sdk"], strict=True)])
    return out
