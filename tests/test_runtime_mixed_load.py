"""A running stream keeps its pace while another client sends long prompts: the two real
worker processes (embedded model, CPU), two raw protocol clients on their own sockets.

Stream A (batch 1, greedy) is timed alone, then while client B sends long prompts back
to back (max_tokens 1). Each step carries A's decode row and at most
`max_prefill_tokens` of B's prompt (chunked prefill, decode first), so A's
inter-token latency grows by at most one chunk's cost per step, not by B's whole
prefills; the steps' counters in `status` (and their /metrics families) show the
chunked and mixed steps that carried them.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from tests.engine_pair import Client, EnginePair
from tests.host_load import on_this_host, wait_for

pytestmark = pytest.mark.slow
CHUNK = 32  # max_prefill_tokens: the prompt tokens one step may carry
LONG_PROMPT = 600  # B's prompts: many chunks each
STREAM_TOKENS = 60
# What chunking guarantees on the CPU: a step of A's decode row and one chunk costs a
# bounded multiple of a decode step, whatever B's prompts' length (a whole 600-token
# prefill per step cost 31x at p50). On the CPU a chunk's rows are not hidden under the
# weight read as on the GPU: a 32-token chunk step costs about two decode steps.
P50_RATIO = 4.0
P99_RATIO = 8.0
ATTEMPTS = 3  # a busy host's noise can spoil one measurement; a design that stalls fails all


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with EnginePair(tmp_path_factory.mktemp("run"), device="cpu", dtype="float32", max_prefill_tokens=CHUNK,
                    prefill_buckets=[16, CHUNK]) as engine:
        yield engine


def stream_gaps(client: Client, tokens: int = STREAM_TOKENS) -> list[float]:
    """Seconds between A's tokens as it receives them (a chunk of k tokens: k gaps of its share)."""
    rid = client.send({"type": "generate", "prompt_token_ids": list(range(10, 40)), "stream": True,
                       "sampling": {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}})
    arrivals: list[tuple[float, int]] = []
    while True:
        reply = client._next_for(rid, time.monotonic() + on_this_host(60))
        assert reply is not None, "stream A stalled"
        if reply["type"] != "chunk":
            assert reply["type"] == "final", reply
            break
        arrivals.append((time.monotonic(), len(reply["token_ids"])))
    gaps: list[float] = []
    for (before, _), (after, count) in zip(arrivals, arrivals[1:]):
        gaps += [(after - before) / count] * count
    assert len(gaps) >= tokens - 2
    return gaps


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class LongPrompts:
    """Client B: long prompts back to back (fresh tokens each, so the prefix cache holds
    none of them), each waited for to its end."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.done = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = random.Random(0)
        try:
            while not self._stop.is_set():
                prompt = [rng.randrange(4, 60) for _ in range(LONG_PROMPT)]
                final, _ = self.client.generate(timeout=on_this_host(120), prompt_token_ids=prompt, stream=False,
                                                sampling={"max_tokens": 1})
                assert final["type"] == "final", final
                self.done += 1
        except BaseException as error:  # noqa: BLE001  reported by the test's thread
            self.error = error

    def __enter__(self) -> LongPrompts:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(on_this_host(120))
        assert self.error is None, self.error


def steps(client: Client) -> dict:
    return client.request({"type": "status"}, timeout=on_this_host(30))["status"]["steps"]


def test_a_streams_pace_holds_while_another_client_sends_long_prompts(pair):
    a, b = pair.client(version=3), pair.client(version=3)
    try:
        stream_gaps(a, 8)  # warm: the decode path, then the mixed steps' shapes
        with LongPrompts(b) as flood:
            wait_for(lambda: flood.done >= 1 or flood.error is not None, 120, "client B's first prompt never ended")
            stream_gaps(a, 8)
        measured = []
        for _ in range(ATTEMPTS):
            alone = stream_gaps(a)
            with LongPrompts(b) as flood:
                wait_for(lambda: flood.done >= 1 or flood.error is not None, 120, "client B's first prompt never ended")
                before = steps(a)
                during = stream_gaps(a)
                after = steps(a)
            # B's prompts ran beside A's stream, in chunks, in steps that carried A's tokens too.
            assert after["chunked_prefill"] - before["chunked_prefill"] >= STREAM_TOKENS // 2
            assert after["mixed"] - before["mixed"] >= STREAM_TOKENS // 2
            ratios = (quantile(during, 0.5) / quantile(alone, 0.5), quantile(during, 0.99) / quantile(alone, 0.99))
            measured.append((*(round(r, 1) for r in ratios),
                             *(f"{quantile(g, q) * 1e3:.1f} ms" for g in (alone, during) for q in (0.5, 0.99))))
            if ratios[0] <= P50_RATIO and ratios[1] <= P99_RATIO:
                break
        else:
            pytest.fail(f"A's ITL while B sends long prompts, as a multiple of alone (p50, p99), then alone's and during's p50 and p99: {measured}; "
                        f"bounds {P50_RATIO}, {P99_RATIO}")
    finally:
        a.close()
        b.close()
