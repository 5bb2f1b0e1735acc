"""The decoupled runtime on the CPU: two real worker processes, real ZeroMQ sockets and
real POSIX shared memory, checked against the engine core running alone in-process."""

from __future__ import annotations

import json
import os
import shutil
import time

import msgpack
import pytest
import torch

from hybridd.config import EMBEDDED_MODEL
from hybridd.model import load_model, load_tokenizer
from hybridd.engine.generate import greedy_generate
from tests.engine_pair import EnginePair

pytestmark = pytest.mark.slow
# On the GPU machine: HYBRIDD_TEST_DEVICE=cuda runs the same tests over CUDA IPC, in
# float32 so that greedy tokens can be compared with the CPU float32 reference.
DEVICE = os.environ.get("HYBRIDD_TEST_DEVICE", "cpu")
ENGINE = {"device": DEVICE, "dtype": "float32"}


@pytest.fixture(scope="module")
def reference():
    return load_model(EMBEDDED_MODEL, dtype=torch.float32), load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with EnginePair(tmp_path_factory.mktemp("run"), **ENGINE) as engine:
        yield engine


@pytest.fixture
def client(pair):
    c = pair.client()
    yield c
    c.close()


PROMPTS = [
    "ROMEO:", "JULIET:\nO Romeo", "HAMLET:\nTo be, or not to be", "First Citizen:\nBefore we proceed",
    "KING LEAR:\nBlow, winds", "MACBETH:\nIs this a dagger", "PORTIA:\nThe quality of mercy", "OTHELLO:\nIt is the cause",
    "PROSPERO:\nOur revels now are ended", "BRUTUS:\nRomans, countrymen", "VIOLA:\nI left no ring with her",
    "PUCK:\nIf we shadows have offended", "IAGO:\nI am not what I am", "LADY MACBETH:\nOut, damned spot",
    "FALSTAFF:\nThe better part of valour", "CAESAR:\nCowards die many times before their deaths;",
]


def test_one_request_equals_engine_alone(client, reference):
    model, tokenizer = reference
    ids = tokenizer.encode("ROMEO:")
    expected = greedy_generate(model, [ids], 40)[0]
    final, chunks = client.generate(prompt="ROMEO:", sampling={"max_tokens": 40, "temperature": 0.0})
    assert final["type"] == "final", final
    assert final["token_ids"] == expected
    assert final["finish_reason"] == "length"
    assert final["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert "".join(c["text"] for c in chunks) == final["text"]
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    assert final["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 40}


def test_sixteen_concurrent_requests_each_equal_alone(client, reference):
    model, tokenizer = reference
    rids = {}
    for i, prompt in enumerate(PROMPTS):
        max_tokens = 8 + 5 * i
        rid = client.send({"type": "generate", "prompt": prompt, "sampling": {"max_tokens": max_tokens, "temperature": 0.0}})
        rids[rid] = (prompt, max_tokens)
    finals = {rid: client.collect(rid, timeout=120)[0] for rid in rids}
    for rid, (prompt, max_tokens) in rids.items():
        expected = greedy_generate(model, [tokenizer.encode(prompt)], max_tokens)[0]
        assert finals[rid]["token_ids"] == expected, prompt
        assert finals[rid]["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible(client):
    sampling = {"max_tokens": 24, "temperature": 0.9, "top_k": 50, "top_p": 0.9, "seed": 1234}
    first, _ = client.generate(prompt="JULIET:", sampling=sampling)
    # Again, this time beside other requests, so it sits in another batch row.
    others = [client.send({"type": "generate", "prompt": p, "sampling": {"max_tokens": 20, "temperature": 1.0}})
              for p in PROMPTS[:3]]
    second, _ = client.generate(prompt="JULIET:", sampling=sampling)
    assert first["token_ids"] == second["token_ids"]
    third, _ = client.generate(prompt="JULIET:", sampling={**sampling, "seed": 99})
    assert third["token_ids"] != first["token_ids"]
    for rid in others:
        client.collect(rid)


def test_stop_string_and_stop_token(client, reference):
    model, tokenizer = reference
    ids = tokenizer.encode("ROMEO:")
    expected = greedy_generate(model, [ids], 40)[0]
    text = tokenizer.decode(expected, skip_special_tokens=True)
    stop = "stay"
    assert stop in text
    final, chunks = client.generate(prompt="ROMEO:", sampling={"max_tokens": 40, "temperature": 0.0, "stop": [stop]})
    assert final["finish_reason"] == "stop"
    assert final["text"] == text[: text.index(stop)]
    assert stop not in "".join(c["text"] for c in chunks)
    final, _ = client.generate(prompt="ROMEO:", sampling={"max_tokens": 40, "temperature": 0.0,
                                                          "stop_token_ids": [expected[5]]})
    assert final["finish_reason"] == "stop"
    assert final["token_ids"] == expected[: expected.index(expected[5]) + 1]


def test_cancel_before_start_midstream_and_twice(client):
    rid = client.send({"type": "generate", "prompt": "ROMEO:", "sampling": {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}})
    client.send({"type": "cancel", "target": rid})
    client.send({"type": "cancel", "target": rid})
    final, _ = client.collect(rid)
    assert final["finish_reason"] == "cancelled"

    rid = client.send({"type": "generate", "prompt": "ROMEO:", "sampling": {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}})
    for _ in range(3):
        assert client._next_for(rid, time.monotonic() + 10)["type"] == "chunk"
    client.send({"type": "cancel", "target": rid})
    final, _ = client.collect(rid)
    assert final["finish_reason"] == "cancelled"
    assert 3 <= final["usage"]["completion_tokens"] < 400
    client.send({"type": "cancel", "target": rid})  # after the end: nothing happens
    client.send({"type": "cancel", "target": "never-existed"})
    assert client.request({"type": "health"})["ok"]


def test_request_timeout(client):
    final, _ = client.generate(prompt="ROMEO:", timeout_s=0.3,
                               sampling={"max_tokens": 2000, "temperature": 0.0, "ignore_eos": True})
    assert final["finish_reason"] in ("timeout", "length")
    assert final["finish_reason"] == "timeout" or final["usage"]["completion_tokens"] == 2000


@pytest.mark.parametrize(
    ("message", "code", "field"),
    [
        ({"type": "generate", "prompt": "x", "sampling": {"max_tokens": 0}}, "invalid_request", "sampling.max_tokens"),
        ({"type": "generate", "prompt": "x", "sampling": {"temperature": "hot"}}, "invalid_request", "sampling.temperature"),
        ({"type": "generate", "prompt": "x", "colour": "red"}, "invalid_request", "colour"),
        ({"type": "generate", "prompt_token_ids": [999999]}, "invalid_request", "prompt_token_ids"),
        ({"type": "generate", "prompt": "ROMEO " * 1500}, "invalid_request", "prompt"),
        ({"type": "generate", "prompt": "x" * (2 << 20)}, "too_large", "prompt"),
        ({"type": "teleport"}, "invalid_request", "type"),
    ],
)
def test_bad_requests_get_clear_errors(client, message, code, field):
    reply = client.request(message, timeout=10)
    assert reply is not None and reply["type"] == "error", reply
    assert reply["code"] == code
    if field:
        assert reply["field"] == field, reply
    assert reply["message"]
    assert client.request({"type": "health"}, timeout=10)["ok"]


def test_oversized_frame_is_dropped_and_daemon_serves_on(pair):
    client = pair.client()
    try:
        # Over ZeroMQ's MAXMSGSIZE: the connection is dropped without a reply.
        client.send_raw(msgpack.packb({"v": 1, "type": "generate", "id": "big", "prompt": "x" * (5 << 20)}))
        assert client.recv(1.0) is None
    finally:
        client.close()
    fresh = pair.client()
    try:
        final, _ = fresh.generate(prompt="ROMEO:", sampling={"max_tokens": 5, "temperature": 0.0})
        assert final["finish_reason"] == "length"
    finally:
        fresh.close()


def test_malformed_frames_and_others_unaffected(pair, client):
    other = pair.client()
    try:
        rid = other.send({"type": "generate", "prompt": "HAMLET:", "sampling": {"max_tokens": 30, "temperature": 0.0}})
        client.send_raw(b"\xc1\xc1 not msgpack")
        reply = client.recv(10)
        assert reply["type"] == "error" and reply["code"] == "malformed"
        client.send_raw(msgpack.packb([1, 2, 3]))
        assert client.recv(10)["code"] == "malformed"
        client.send_raw(msgpack.packb({"v": 99, "type": "health", "id": "x"}))
        assert client.recv(10)["code"] == "unsupported_version"
        final, _ = other.collect(rid)
        assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 30
    finally:
        other.close()


def test_status_reports_engine(client):
    status = client.request({"type": "status"})["status"]
    assert status["state"] == "ready"
    kv = status["kv_blocks"]
    assert kv["total"] > 0 and kv["used"] + kv["free"] == kv["total"]
    assert status["requests"]["served"] >= 1
    assert {b["kind"] for b in status["buckets"]} == {"decode", "prefill", "mixed"}
    assert status["latency"]["itl_p50_s"] is not None


def test_kv_exhaustion_queues_and_preempts_then_completes(tmp_path, reference):
    model, tokenizer = reference
    # 20 blocks of 16 tokens (320 slots) for 8 requests that grow to ~100 tokens each.
    engine = EnginePair(tmp_path, num_kv_blocks=20, max_batch=8, decode_buckets=[1, 2, 4, 8], **ENGINE)
    try:
        engine.wait_ready()
        client = engine.client()
        rids = {client.send({"type": "generate", "prompt": p, "sampling": {"max_tokens": 90, "temperature": 0.0,
                                                                             "ignore_eos": True}}): p
                for p in PROMPTS[:8]}
        finals = {rid: client.collect(rid, timeout=180)[0] for rid in rids}
        for rid, prompt in rids.items():
            expected = greedy_generate(model, [tokenizer.encode(prompt)], 90)[0]
            assert finals[rid]["token_ids"] == expected, prompt
        status = client.request({"type": "status"})["status"]
        assert status["kv_blocks"]["used"] == 0
        assert status["requests"]["preemptions"] > 0
        # A request that could never fit the cache is refused up front, naming the limit.
        reply = client.request({"type": "generate", "prompt": "ROMEO:", "sampling": {"max_tokens": 400}})
        assert reply["type"] == "error" and "num_blocks" in reply["message"]
        client.close()
    finally:
        engine.close()


def test_generation_config_stop_tokens_end_requests_where_transformers_stops(tmp_path, reference):
    """generation_config.json lists several stop tokens (as Llama 3 does): the request
    ends at the first one generated, exactly where transformers' `generate` ends it."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = reference
    ids = tokenizer.encode("ROMEO:")
    expected = greedy_generate(model, [ids], 20)[0]
    k = next(i for i in range(4, 20) if expected[i] not in expected[:i])
    unused = next(t for t in range(3, model.config.vocab_size) if t not in expected)
    model_dir = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL, model_dir)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = [unused, expected[k]]
    (model_dir / "generation_config.json").write_text(json.dumps(generation))
    with torch.inference_mode():
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf_ids = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    assert hf_ids == expected[: k + 1]  # transformers stopped early, on the listed token

    engine = EnginePair(tmp_path / "run", model=str(model_dir), **ENGINE)
    (tmp_path / "run").mkdir(exist_ok=True)
    try:
        engine.wait_ready()
        client = engine.client()
        final, _ = client.generate(prompt="ROMEO:", sampling={"max_tokens": 20, "temperature": 0.0})
        assert final["finish_reason"] == "stop"
        assert final["token_ids"] == hf_ids
        final, _ = client.generate(prompt="ROMEO:", sampling={"max_tokens": 20, "temperature": 0.0, "ignore_eos": True})
        assert final["finish_reason"] == "length" and final["token_ids"] == expected
        client.close()
    finally:
        engine.close()


def test_prompt_longer_than_prefill_budget_runs_alone(tmp_path, reference):
    model, tokenizer = reference
    text = (EMBEDDED_MODEL / "validation.txt").read_text()[:2000]
    ids = tokenizer.encode(text)[:150]
    expected = greedy_generate(model, [ids], 12)[0]
    engine = EnginePair(tmp_path, max_prefill_tokens=64, prefill_buckets=[16, 32, 64], **ENGINE)
    try:
        engine.wait_ready()
        client = engine.client()
        final, _ = client.generate(prompt_token_ids=ids, sampling={"max_tokens": 12, "temperature": 0.0})
        assert final["type"] == "final" and final["token_ids"] == expected
        client.close()
    finally:
        engine.close()


def test_queue_limit_answers_overloaded(tmp_path):
    engine = EnginePair(tmp_path, max_queued_requests=2, **ENGINE)
    try:
        engine.wait_ready()
        client = engine.client()
        long = {"max_tokens": 500, "temperature": 0.0, "ignore_eos": True}
        held = [client.send({"type": "generate", "prompt": "ROMEO:", "sampling": long}) for _ in range(2)]
        reply = client.request({"type": "generate", "prompt": "ROMEO:", "sampling": long})
        assert reply["type"] == "error" and reply["code"] == "overloaded" and "max_queued_requests" in reply["message"]
        for rid in held:
            client.send({"type": "cancel", "target": rid})
            assert client.collect(rid)[0]["finish_reason"] == "cancelled"
        final, _ = client.generate(prompt="ROMEO:", sampling={"max_tokens": 3})
        assert final["finish_reason"] == "length"
        client.close()
    finally:
        engine.close()
