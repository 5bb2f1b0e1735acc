"""What the HTTP gateway adds at the client: TTFT and ITL p50 of the same greedy
requests streamed through the OpenAI-compatible gateway (`/v1/completions`, SSE, read
with httpx) and through the SDK (`hybridd.Client.stream`), interleaved in one run
against one daemon.

    python scripts/bench_gateway.py --endpoint ipc:///run/hybridd/hybridd.sock --model /path/to/model

scripts/bench.py runs `measure_gateway` inside its `hybridd` part. The gateway runs as
its own process (`python -m hybridd.gateway.process`), as under the supervisor. Both
sides count the same events: the first reply of a request for TTFT, and replies that
carry text for ITL (the gateway sends no event for a chunk whose text is still held
back, so the SDK side skips those too).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class Gateway:
    """The gateway process on a free loopback port, against `endpoint`."""

    def __init__(self, endpoint: str, model: str) -> None:
        import httpx

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([
            sys.executable, "-m", "hybridd.gateway.process", "--endpoint", endpoint,
            "--http-endpoint", f"127.0.0.1:{self.port}", "--model", model, "--log-level", "warning",
        ])
        self.model = Path(model).name
        self.http = httpx.Client(base_url=self.url, timeout=300.0)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.process.returncode}")
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the gateway was not healthy within {READY_TIMEOUT_S} s")
            time.sleep(0.1)

    def stream(self, ids: list[int], max_tokens: int) -> tuple[float, list[float]]:
        """(TTFT, arrival times of the events that carry text) of one streamed completion."""
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        sent = time.perf_counter()
        first, times = None, []
        with self.http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                now = time.perf_counter()
                if not line.startswith("data: {"):
                    continue
                first = first or now
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"gateway error: {event['error']}")
                if event["choices"] and event["choices"][0]["text"]:
                    times.append(now)
        if first is None:
            raise RuntimeError("the gateway streamed no event")
        return first - sent, times

    def close(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


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
    """TTFT and ITL p50 through HTTP and through the SDK, interleaved; and what HTTP adds."""
    from hybridd.client import Client

    gateway = Gateway(endpoint, model)
    try:
        with Client(endpoint, timeout=300.0) as sdk:
            prompt = lambda: [rng.randrange(3, vocab) for _ in range(prompt_len)]  # noqa: E731
            for fn in (gateway.stream, lambda ids, n: _sdk_stream(sdk, ids, n)):  # warm-up
                fn(prompt(), 4)
            ttft: dict[str, list[float]] = {"http": [], "sdk": []}
            gaps: dict[str, list[float]] = {"http": [], "sdk": []}
            for _ in range(ttft_reps):
                ids = prompt()
                ttft["sdk"].append(_sdk_stream(sdk, ids, 1)[0])
                ttft["http"].append(gateway.stream(ids, 1)[0])
            for _ in range(itl_runs):
                ids = prompt()
                gaps["sdk"].extend(_gaps(_sdk_stream(sdk, ids, itl_tokens)[1]))
                gaps["http"].extend(_gaps(gateway.stream(ids, itl_tokens)[1]))
    finally:
        gateway.close()
    out: dict[str, Any] = {"prompt_tokens": prompt_len, "itl_tokens": itl_tokens, "http_client": "httpx (SSE lines)"}
    for side in ("sdk", "http"):
        out[side] = {"ttft_p50_s": _p50(ttft[side]), "itl_p50_s": _p50(gaps[side]), "ttft_n": len(ttft[side]),
                     "itl_n": len(gaps[side])}
    for key in ("ttft_p50_s", "itl_p50_s"):
        http, sdk_value = out["http"][key], out["sdk"][key]
        out[f"added_{key}"] = http - sdk_value if http is not None and sdk_value is not None else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True, help="the running daemon's endpoint")
    parser.add_argument("--model", required=True, help="the daemon's model directory (its name is the model id)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    result = measure_gateway(args.endpoint, args.model, prompt_len=args.prompt_len, ttft_reps=args.reps,
                             itl_tokens=args.tokens, itl_runs=args.runs, vocab=args.vocab, rng=random.Random(0))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
