"""The client SDK against the real daemon: `hybridd start` with the embedded tiny model,
its two real workers, real sockets. One daemon serves the whole module; the restart
test runs last because it kills a worker."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

import hybridd
from hybridd import (
    AsyncClient,
    Client,
    EngineDeadError,
    InvalidRequestError,
    RequestCancelledError,
    RequestTimeoutError,
)
from tests.daemon import RunningDaemon, run_daemon, wait_idle, wait_until_ok
from tests.host_load import on_this_host

LONG = {"max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def daemon() -> Iterator[RunningDaemon]:
    with run_daemon() as running:
        yield running


@pytest.fixture
def client(daemon) -> Iterator[Client]:
    with Client(daemon.endpoint, timeout=60) as c:
        yield c


def test_generate_returns_text_ids_reason_usage_and_timings(client):
    result = client.generate("ROMEO:", max_tokens=12, temperature=0)
    assert len(result.id) == 32 and int(result.id, 16) >= 0  # 128 random bits in hex
    assert result.finish_reason == "length"
    assert len(result.token_ids) == result.usage.completion_tokens == 12
    assert result.usage.prompt_tokens > 0
    assert result.text
    assert 0 <= result.timings.queue_s <= result.timings.ttft_s <= result.timings.total_s and result.timings.ttft_s > 0
    again = client.generate("ROMEO:", sampling=hybridd.SamplingParams(max_tokens=12, temperature=0),
                            request_id="my-id")
    assert again.id == "my-id"
    assert again.token_ids == result.token_ids  # greedy is deterministic


def test_stream_yields_chunks_that_add_up_to_the_result(client):
    stream = client.stream("JULIET:", max_tokens=20, temperature=0)
    chunks = list(stream)
    assert chunks and all(c.index == 0 for c in chunks)  # one sequence
    assert "".join(c.text for c in chunks) == stream.result.text
    assert [t for c in chunks for t in c.token_ids] == stream.result.token_ids[: sum(len(c.token_ids) for c in chunks)]
    assert stream.result.finish_reason == "length"


def test_one_client_is_shared_by_many_threads(client):
    results: dict[int, hybridd.GenerateResult] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            if i % 2:
                results[i] = client.generate("HAMLET:", max_tokens=8, seed=i)
            else:
                stream = client.stream("HAMLET:", max_tokens=8, seed=i)
                for _ in stream:
                    pass
                results[i] = stream.result
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(results) == 12 and len({r.id for r in results.values()}) == 12
    assert all(r.usage.completion_tokens == 8 for r in results.values())


def test_cancel_ends_a_running_request_with_its_partial_output(client):
    stream = client.stream("ROMEO:", **LONG)
    first = next(stream)
    client.cancel(stream.id)
    client.cancel(stream.id)  # idempotent
    with pytest.raises(RequestCancelledError) as caught:
        for _ in stream:
            pass
    assert caught.value.code == "cancelled"
    assert caught.value.partial is not None
    assert caught.value.partial.token_ids[: len(first.token_ids)] == first.token_ids
    client.cancel("never-existed")  # a no-op


@pytest.mark.parametrize("how", ["close", "garbage collection"])
def test_dropping_a_stream_cancels_it(client, how):
    stream = client.stream("ROMEO:", **LONG)
    next(stream)
    assert client.status()["requests"]["running"] >= 1
    if how == "close":
        stream.close()
    else:
        del stream
        gc.collect()
    assert wait_idle(client, 2.0)["running"] == 0


def test_per_call_timeout(client):
    started = time.monotonic()
    with pytest.raises(RequestTimeoutError) as caught:
        client.generate("ROMEO:", timeout=0.3, **LONG)
    assert isinstance(caught.value, TimeoutError)
    assert time.monotonic() - started < on_this_host(1.5)
    assert wait_idle(client, 2.0)["running"] == 0  # the daemon stopped the work too


def test_invalid_requests_raise_typed_errors_naming_the_field(client):
    with pytest.raises(InvalidRequestError) as local:
        client.generate("ROMEO:", top_p=0.0)
    assert local.value.field == "sampling.top_p" and local.value.code == "invalid_request"
    with pytest.raises(InvalidRequestError) as remote:
        client.generate([2**31 - 1], max_tokens=2)  # outside the vocabulary: only the daemon knows
    assert remote.value.code == "invalid_request"
    with pytest.raises(TypeError):
        client.generate("ROMEO:", temprature=0.5)
    stream = client.stream("ROMEO:", request_id="dup", **LONG)
    with pytest.raises(InvalidRequestError) as duplicate:
        client.generate("ROMEO:", request_id="dup")
    assert duplicate.value.field == "id"
    stream.close()


def test_size_limits_are_enforced_before_sending(client):
    from hybridd.protocol.limits import MAX_MESSAGE_BYTES, MAX_PROMPT_CHARS

    with pytest.raises(InvalidRequestError) as too_long:
        client.generate("x" * (MAX_PROMPT_CHARS + 1))
    assert too_long.value.code == "too_large" and too_long.value.field == "prompt"
    wide = "\U0001F600" * MAX_PROMPT_CHARS  # legal in characters, 4 MiB of UTF-8: over the frame limit
    assert len(wide.encode()) >= MAX_MESSAGE_BYTES
    with pytest.raises(InvalidRequestError) as too_big:
        client.generate(wide)
    assert too_big.value.code == "too_large"
    with pytest.raises(InvalidRequestError) as long_id:
        client.generate("ROMEO:", request_id="i" * 129)
    assert long_id.value.code == "too_large" and long_id.value.field == "id"
    assert client.health().ok  # the session is unharmed


def test_status_and_health(client):
    health = client.health()
    assert health == hybridd.Health(state="ready", ok=True)
    status = client.status()
    for key in ("state", "uptime_s", "model", "dtype", "device", "workers", "buckets", "graph_bytes",
                "graph_pool_bytes", "graph_memory_budget_bytes", "kv_blocks", "requests", "latency"):
        assert key in status, key
    assert status["state"] == "ready"
    assert set(status["workers"]) == {"graph", "context"}
    assert all(w["pid"] > 0 for w in status["workers"].values())
    assert {b["kind"] for b in status["buckets"]} == {"decode", "prefill", "mixed"}
    assert set(status["kv_blocks"]) >= {"total", "used", "free"}
    assert set(status["requests"]) >= {"running", "queued", "served", "failed"}
    assert set(status["latency"]) >= {"ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "window"}
    assert status["version"] == hybridd.__version__
    assert status["max_model_len"] > 0
    assert status["tokens_per_s"] > 0  # earlier tests of this module generated within the minute
    assert status["kv_usage"] == status["kv_blocks"]["used"] / status["kv_blocks"]["total"]
    assert status["endpoints"] == {"ipc": client.endpoint, "tcp": None}
    assert status["last_restart_reason"] is None
    # device "auto" on a host without MPS (or "cpu": "off (CPU device)")
    assert status["cuda_mps"] in ("off (CPU device)", "off (nvidia-cuda-mps-control is not on PATH)")


def test_async_client(daemon):
    async def main() -> None:
        async with AsyncClient(daemon.endpoint, timeout=60) as client:
            assert (await client.health()).ok
            results = await asyncio.gather(*(client.generate("KING:", max_tokens=6, seed=i) for i in range(6)))
            assert all(r.usage.completion_tokens == 6 for r in results)
            stream = client.stream("KING:", max_tokens=10, temperature=0)
            texts = [chunk.text async for chunk in stream]
            assert "".join(texts) == stream.result.text
            assert (await client.status())["state"] == "ready"

            dropped = client.stream("KING:", **LONG)
            await dropped.__anext__()
            await dropped.aclose()
            cancelled = client.stream("KING:", **LONG)
            await cancelled.__anext__()
            await client.cancel(cancelled.id)
            with pytest.raises(RequestCancelledError):
                async for _ in cancelled:
                    pass
            with pytest.raises(RequestTimeoutError):
                await client.generate("KING:", timeout=0.2, **LONG)
            task = asyncio.ensure_future(client.generate("KING:", **LONG))
            await asyncio.sleep(0.2)
            task.cancel()  # cancelling the awaiting task cancels the request
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 2
            while (await client.status())["requests"]["running"] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert (await client.status())["requests"]["running"] == 0

    asyncio.run(main())


CHAT = [{"role": "system", "content": "Enter JULIET, above."},
        {"role": "user", "content": "What light through yonder window breaks?"}]


def test_chat_whole_and_streamed(client):
    from transformers import AutoTokenizer

    from hybridd.config import EMBEDDED_MODEL

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    result = client.chat(CHAT, max_tokens=10, temperature=0)
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.token_ids == client.generate(prompt_ids, max_tokens=10, temperature=0).token_ids
    stream = client.chat_stream([hybridd.ChatMessage(**m) for m in CHAT], max_tokens=10, temperature=0)
    assert "".join(chunk.text for chunk in stream) == stream.result.text == result.text
    with pytest.raises(InvalidRequestError) as info:
        client.chat([{"role": "", "content": "hi"}])
    assert info.value.field == "messages[0].role"


def test_logprobs_in_results_and_chunks(client):
    result = client.generate("ROMEO:", max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    assert len(result.logprobs) == len(result.token_ids) == 8
    for token, entry in zip(result.token_ids, result.logprobs, strict=True):
        assert entry.token_id == token and entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token_id == token  # greedy: the most likely token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    stream = client.stream("ROMEO:", max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    streamed = [entry for chunk in stream for entry in chunk.logprobs]
    assert stream.result.logprobs == streamed
    assert [e.token_id for e in streamed] == result.token_ids
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in result.logprobs], abs=1e-5)
    assert client.generate("ROMEO:", max_tokens=2).logprobs is None
    with pytest.raises(InvalidRequestError) as info:
        client.generate("ROMEO:", top_logprobs=2)
    assert info.value.field == "sampling.top_logprobs"


def test_n_sequences_in_choices_and_indexed_chunks(client):
    result = client.generate("KING:", max_tokens=6, seed=9, n=3, ignore_eos=True)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert result.text == result.choices[0].text and result.token_ids == result.choices[0].token_ids
    assert result.usage.completion_tokens == 18  # the prompt counted once:
    assert result.usage.prompt_tokens == client.generate("KING:", max_tokens=1).usage.prompt_tokens
    assert client.generate("KING:", max_tokens=6, seed=9, ignore_eos=True).token_ids == result.token_ids
    stream = client.stream("KING:", max_tokens=6, seed=9, n=3, ignore_eos=True, logprobs=True)
    chunks = list(stream)
    for choice in stream.result.choices:
        mine = [c for c in chunks if c.index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [e.token_id for c in mine for e in c.logprobs] == choice.token_ids
        assert len(choice.logprobs) == len(choice.token_ids)
    assert [c.token_ids for c in stream.result.choices] == [c.token_ids for c in result.choices]


def test_async_chat_and_n(daemon):
    async def main() -> None:
        async with AsyncClient(daemon.endpoint, timeout=60) as client:
            result = await client.chat(CHAT, max_tokens=6, seed=4, n=2)
            assert len(result.choices) == 2 and result.usage.completion_tokens == sum(
                len(c.token_ids) for c in result.choices)
            stream = client.chat_stream(CHAT, max_tokens=6, seed=4, n=2, logprobs=True, top_logprobs=1)
            chunks = [chunk async for chunk in stream]
            assert {c.index for c in chunks} == {0, 1}
            assert [c.token_ids for c in stream.result.choices] == [c.token_ids for c in result.choices]
            assert all(len(c.logprobs) == len(c.token_ids) for c in stream.result.choices)

    asyncio.run(main())


def test_32_concurrent_streams_while_malformed_messages_arrive(daemon):
    """32 streams at once (async) and 32 sync threads, while a raw socket sends every kind
    of bad message: each bad one gets a clear error, every stream completes whole."""
    import msgpack
    import zmq

    from hybridd.protocol import codec

    bad_messages = [
        (b"\xc1 definitely not msgpack", "malformed"),
        (msgpack.packb([1, 2, 3]), "malformed"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "t", "prompt": 5}), "invalid_request"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "u", "prompt": "x", "colour": 1}), "invalid_request"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "m", "prompt": "x", "sampling": {"max_tokens": 0}}),
         "invalid_request"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "l", "prompt": "ROMEO " * 3000}), "invalid_request"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "a", "prompt": "x",
                        "sampling": {"max_tokens": 10**12}}), "invalid_request"),
        (msgpack.packb({"v": 1, "type": "generate", "id": "s", "prompt": "x" * (2 << 20)}), "too_large"),
        (msgpack.packb({"v": 7, "type": "health", "id": "v"}), "unsupported_version"),
    ]
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(daemon.endpoint)

    async def streams() -> list:
        async with AsyncClient(daemon.endpoint, timeout=on_this_host(120)) as client:
            async def one(i: int) -> str:
                stream = client.stream("KING:", max_tokens=24, seed=i, ignore_eos=True)
                texts = [chunk.text async for chunk in stream]
                assert stream.result.usage.completion_tokens == 24
                assert "".join(texts) == stream.result.text
                return stream.result.text

            return await asyncio.gather(*(one(i) for i in range(32)))

    sync_results: dict[int, int] = {}

    def sync_stream(client: Client, i: int) -> None:
        stream = client.stream("QUEEN:", max_tokens=16, seed=i, ignore_eos=True)
        for _ in stream:
            pass
        sync_results[i] = stream.result.usage.completion_tokens

    errors = []
    try:
        with Client(daemon.endpoint, timeout=on_this_host(120)) as sync_client:
            threads = [threading.Thread(target=sync_stream, args=(sync_client, i)) for i in range(32)]
            for t in threads:
                t.start()
            for frame, _ in bad_messages:
                raw.send(frame)
            texts = asyncio.run(streams())
            for t in threads:
                t.join(120)
            for _ in bad_messages:
                assert raw.poll(10_000), "no error reply"
                errors.append(codec.decode(raw.recv()))
    finally:
        raw.close()
        context.term()
    assert len(texts) == 32 and sorted(sync_results) == list(range(32)) and set(sync_results.values()) == {16}
    assert sorted(e["code"] for e in errors) == sorted(code for _, code in bad_messages)
    assert all(e["type"] == "error" and e["message"] for e in errors)


def test_worker_death_fails_in_flight_requests_and_the_client_reconnects(daemon, client):
    # Last in this module: it restarts the daemon's worker pair.
    before = client.status()["workers"]
    stream = client.stream("ROMEO:", **LONG)
    next(stream)
    killed_at = time.monotonic()
    os.kill(before["context"]["pid"], signal.SIGKILL)
    with pytest.raises(EngineDeadError) as caught:
        for _ in stream:
            pass
    assert time.monotonic() - killed_at < on_this_host(1.0)
    assert caught.value.code == "engine_dead"
    wait_until_ok(daemon.endpoint, on_this_host(60))
    result = client.generate("ROMEO:", max_tokens=4)  # the same client, reconnected
    assert result.usage.completion_tokens == 4
    status = client.status()
    after = status["workers"]
    assert after["context"]["pid"] != before["context"]["pid"]
    assert after["context"]["restarts"] == before["context"]["restarts"] + 1
    assert status["last_restart_reason"] == f"context generator (pid {before['context']['pid']}) was killed by SIGKILL"


def test_graph_generator_death_gets_error_replies_and_the_pair_restarts(daemon, client):
    # The context generator outlives its peer: it notices the death and answers every
    # in-flight request with a terminal engine_dead error before the pair is restarted.
    wait_until_ok(daemon.endpoint, on_this_host(60))
    before = client.status()["workers"]
    streams = [client.stream(p, **LONG) for p in ("ROMEO:", "JULIET:", "HAMLET:")]
    for stream in streams:
        next(stream)
    killed_at = time.monotonic()
    os.kill(before["graph"]["pid"], signal.SIGKILL)
    for stream in streams:
        with pytest.raises(EngineDeadError):
            for _ in stream:
                pass
    assert time.monotonic() - killed_at < on_this_host(1.0)
    wait_until_ok(daemon.endpoint, on_this_host(60))
    assert client.generate("ROMEO:", max_tokens=4).usage.completion_tokens == 4
    after = client.status()["workers"]
    assert after["graph"]["pid"] != before["graph"]["pid"]
