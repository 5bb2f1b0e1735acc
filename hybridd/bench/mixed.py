"""The bench's chunked-prefill and prefix-cache parts, at the client through the SDK.

`mixed_load`: stream A (batch 1, greedy) alone, then while client B sends long prompts
back to back (max_tokens 1, each new): A's ITL during ÷ alone, B's TTFT during ÷ alone.
`prefix_reuse`: a long prompt's TTFT cold, repeated, and sharing all but its last 64
tokens; a chat of turns each adding the reply and new tokens: the last turn's TTFT ÷
the first's; and the longest prompt the daemon takes (`max_model_len` - 1 tokens, in
chunks: its TTFT and first token) beside one token more, refused naming the length.
Targets: ITL p50 <= 1.5x, p99 <= 2.5x, long-prompt TTFT <= 1.3x; shared-prefix TTFT
<= 0.2x cold; last turn <= 1.5x first.
"""

from __future__ import annotations

import random
import statistics
import threading

from hybridd.bench.timing import at_most, itl_summary, random_prompt, ratio, timed_stream, ttft_summary

SHARED_TAIL = 64  # tokens a "shared prefix" prompt differs in, at its end


def measure_mixed_load(endpoint: str, vocab: int, long_prompt: int, stream_tokens: int, reps: int) -> dict:
    from hybridd.client import Client

    a, b = Client(endpoint, timeout=600.0), Client(endpoint, timeout=600.0)
    rng_a, rng_b = random.Random(11), random.Random(12)
    try:
        timed_stream(a, random_prompt(rng_a, 32, vocab), 8)  # warm-ups
        timed_stream(b, random_prompt(rng_b, long_prompt, vocab), 1)
        alone_gaps = timed_stream(a, random_prompt(rng_a, 32, vocab), stream_tokens)[0].gaps
        alone_ttft = [timed_stream(b, random_prompt(rng_b, long_prompt, vocab), 1)[0].ttft for _ in range(reps)]
        stop, during_ttft, started = threading.Event(), [], threading.Event()

        def flood() -> None:  # client B: long prompts back to back, each unseen
            while not stop.is_set():
                started.set()
                during_ttft.append(timed_stream(b, random_prompt(rng_b, long_prompt, vocab), 1)[0].ttft)

        thread = threading.Thread(target=flood, name="client-b", daemon=True)
        thread.start()
        started.wait(60)
        during_gaps = timed_stream(a, random_prompt(rng_a, 32, vocab), stream_tokens)[0].gaps
        stop.set()
        thread.join(600)
    finally:
        a.close()
        b.close()
    alone, during = itl_summary(alone_gaps), itl_summary(during_gaps)
    ttft_alone, ttft_during = ttft_summary(alone_ttft), ttft_summary(during_ttft)
    out = {"long_prompt_tokens": long_prompt, "stream_tokens": stream_tokens, "itl_alone": alone,
           "itl_during": during, "ttft_alone": ttft_alone, "ttft_during": ttft_during,
           "itl_p50_ratio": ratio(during["p50_s"], alone["p50_s"]),
           "itl_p99_ratio": ratio(during["p99_s"], alone["p99_s"]),
           "ttft_ratio": ratio(ttft_during["median_s"], ttft_alone["median_s"])}
    out["targets_met"] = {"itl_p50 <= 1.5x": at_most(out["itl_p50_ratio"], 1.5),
                          "itl_p99 <= 2.5x": at_most(out["itl_p99_ratio"], 2.5),
                          "ttft <= 1.3x": at_most(out["ttft_ratio"], 1.3)}
    return out


def measure_prefix_reuse(endpoint: str, vocab: int, long_prompt: int, turn_tokens: int, turns: int,
                         reps: int) -> dict:
    from hybridd.client import Client

    client, rng = Client(endpoint, timeout=600.0), random.Random(13)
    cold, repeated, shared, chat = [], [], [], []
    try:
        timed_stream(client, random_prompt(rng, long_prompt, vocab), 1)  # warm-up
        for _ in range(reps):
            prompt = random_prompt(rng, long_prompt, vocab)
            cold.append(timed_stream(client, prompt, 1)[0].ttft)
            repeated.append(timed_stream(client, prompt, 1)[0].ttft)
            tail = random_prompt(rng, SHARED_TAIL, vocab)
            shared.append(timed_stream(client, prompt[:-SHARED_TAIL] + tail, 1)[0].ttft)
        longest = longest_prompt(client, rng, vocab)
        history: list[int] = []
        for _ in range(turns):  # each turn: the history, the last reply, new tokens
            history += random_prompt(rng, turn_tokens, vocab)
            record, reply = timed_stream(client, history, 8)
            chat.append(record.ttft)
            history += reply
    finally:
        client.close()
    out = {"long_prompt_tokens": long_prompt, "turn_tokens": turn_tokens, "turns": turns,
           "ttft_cold": ttft_summary(cold), "ttft_repeated": ttft_summary(repeated),
           "ttft_shared_prefix": ttft_summary(shared), "chat_ttft_s": chat,
           "chat_history_tokens": len(history), "longest_prompt": longest}
    cold_s = statistics.median(cold)
    out["repeated_ratio"] = ratio(statistics.median(repeated), cold_s)
    out["shared_prefix_ratio"] = ratio(statistics.median(shared), cold_s)
    out["chat_last_over_first"] = ratio(chat[-1], chat[0])
    out["targets_met"] = {"shared prefix <= 0.2x cold": at_most(out["shared_prefix_ratio"], 0.2),
                          "last turn <= 1.5x first": at_most(out["chat_last_over_first"], 1.5),
                          "max_model_len prompt served, one more refused": longest["served"] and longest["refused"]}
    return out


def longest_prompt(client, rng: random.Random, vocab: int) -> dict:
    """A prompt of `max_model_len` - 1 tokens (room for one generated token): its TTFT and
    whether a token came; and one of `max_model_len` + 1, which must be refused with an
    error that names the model's length."""
    from hybridd.errors import HybriddError

    limit = int(client.status()["max_model_len"])
    record, tokens = timed_stream(client, random_prompt(rng, limit - 1, vocab), 1)
    try:
        timed_stream(client, random_prompt(rng, limit + 1, vocab), 1)
        refusal = None
    except HybriddError as exc:
        refusal = str(exc)
    return {"max_model_len": limit, "ttft_s": record.ttft, "served": len(tokens) == 1,
            "refused": refusal is not None and str(limit) in refusal, "refusal": refusal}
