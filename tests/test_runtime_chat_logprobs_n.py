"""Chat, logprobs and n over the wire (raw pyzmq + msgpack, protocol versions 1 and 2),
against the two real worker processes; the reference is the transformers model itself
(its logits, teacher-forced over the generated ids) and the engine's own single runs."""

from __future__ import annotations

import json
import math
import os
import shutil
import time

import pytest
import torch

from hybridd.config import EMBEDDED_MODEL
from hybridd.engine.sequence import derived_seed
from tests.engine_pair import EnginePair

pytestmark = pytest.mark.slow
DEVICE = os.environ.get("HYBRIDD_TEST_DEVICE", "cpu")
ENGINE = {"device": DEVICE, "dtype": "float32"}
BLOCK = 16  # the default block_size
LOGPROB_TOLERANCE = 2e-3  # float32, different kernels and accumulation orders
CHAT = [
    {"role": "system", "content": "Enter ROMEO and JULIET."},
    {"role": "user", "content": "What light through yonder window breaks?"},
    {"role": "assistant", "content": "It is the east."},
    {"role": "user", "content": "Speak again, bright angel.", "name": "Benvolio"},
]


@pytest.fixture(scope="module")
def hf():
    """The real transformers model and tokenizer of the embedded model, in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with EnginePair(tmp_path_factory.mktemp("run"), **ENGINE) as engine:
        yield engine


@pytest.fixture
def v2(pair):
    c = pair.client(version=2)
    yield c
    c.close()


@pytest.fixture
def v1(pair):
    c = pair.client(version=1)
    yield c
    c.close()


def hf_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at each generated position, teacher-forced."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(output_ids)].log_softmax(dim=-1)


def assert_logprobs_match(entries: list[dict], expected: torch.Tensor, output_ids: list[int], top: int) -> None:
    assert [e["token_id"] for e in entries] == output_ids
    for pos, entry in enumerate(entries):
        row = expected[pos]
        assert entry["logprob"] == pytest.approx(float(row[entry["token_id"]]), abs=LOGPROB_TOLERANCE), pos
        assert len(entry["top_logprobs"]) == top
        values = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True)
        ref_values, ref_ids = row.topk(top)
        assert values == pytest.approx(ref_values.tolist(), abs=LOGPROB_TOLERANCE), pos
        # ids agree except where two alternatives are (numerically) tied
        for alt, ref_id, ref_value in zip(entry["top_logprobs"], ref_ids.tolist(), ref_values.tolist(), strict=True):
            assert alt["token_id"] == ref_id or abs(float(row[alt["token_id"]]) - ref_value) < LOGPROB_TOLERANCE


# ---------------------------------------------------------------- versions


def test_version_1_and_2_side_by_side(v1, v2):
    sampling = {"max_tokens": 6, "temperature": 0.0}
    final1, chunks1 = v1.generate(prompt="ROMEO:", sampling=sampling)
    final2, chunks2 = v2.generate(prompt="ROMEO:", sampling=sampling)
    # version 1: the one sequence at the top level, chunks numbered
    assert final1["v"] == 1 and all(c["v"] == 1 for c in chunks1)
    assert set(final1) == {"v", "type", "id", "text", "token_ids", "finish_reason", "usage", "timings"}
    assert [c["index"] for c in chunks1] == list(range(len(chunks1)))
    assert set(chunks1[0]) == {"v", "type", "id", "index", "text", "token_ids"}
    # version 2: choices, chunks carry their sequence's index and (nil) logprobs
    assert final2["v"] == 2 and all(c["v"] == 2 for c in chunks2)
    assert set(final2) == {"v", "type", "id", "choices", "usage", "timings"}
    (choice,) = final2["choices"]
    assert all(c["index"] == 0 and c["logprobs"] is None for c in chunks2)
    assert choice["logprobs"] is None and choice["index"] == 0
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (
        final1["text"], final1["token_ids"], final1["finish_reason"])
    assert final2["usage"] == final1["usage"]
    # health and errors answer in the request's version
    assert v1.request({"type": "health"})["v"] == 1 and v2.request({"type": "health"})["v"] == 2
    error = v1.request({"type": "generate", "prompt": "x", "sampling": {"n": 2}})
    assert (error["v"], error["code"], error["field"]) == (1, "invalid_request", "sampling.n")
    error = v2.request({"type": "generate", "prompt": "x", "sampling": {"n": 99}})
    assert (error["v"], error["code"], error["field"]) == (2, "invalid_request", "sampling.n")


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("stream", [False, True], ids=["final", "chunks"])
def test_greedy_logprobs_equal_the_models_log_softmax(v2, hf, stream):
    model, tokenizer = hf
    prompt_ids = tokenizer.encode("JULIET:\nO Romeo")
    final, chunks = v2.generate(prompt_token_ids=prompt_ids, stream=stream,
                                sampling={"max_tokens": 12, "temperature": 0.0, "logprobs": True, "top_logprobs": 5})
    (choice,) = final["choices"]
    output = choice["token_ids"]
    if stream:
        assert choice["logprobs"] is None
        entries = [e for c in chunks for e in c["logprobs"]]
        assert all(len(c["logprobs"]) == len(c["token_ids"]) for c in chunks)
    else:
        entries = choice["logprobs"]
    expected = hf_logprobs(model, prompt_ids, output)
    assert output == expected.argmax(dim=-1).tolist()  # greedy: the model's own argmax
    assert_logprobs_match(entries, expected, output, top=5)
    assert entries[0]["text"] == tokenizer.decode([output[0]])


def test_sampled_logprobs_come_from_the_cut_scaled_distribution(v2, hf):
    model, tokenizer = hf
    prompt_ids = tokenizer.encode("ROMEO:")
    temperature, top_k = 0.7, 4
    final, _ = v2.generate(prompt_token_ids=prompt_ids, stream=False, sampling={
        "max_tokens": 8, "temperature": temperature, "top_k": top_k, "seed": 11, "logprobs": True,
        "top_logprobs": 10})
    (choice,) = final["choices"]
    ids = torch.tensor([prompt_ids + choice["token_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1: -1].float() / temperature
    for pos, entry in enumerate(choice["logprobs"]):
        # Only the top_k tokens have mass: the rest are not listed, and the listed ones
        # are the renormalised distribution over exactly those.
        kept_values, kept_ids = logits[pos].topk(top_k)
        expected = kept_values.log_softmax(dim=-1)
        assert [alt["token_id"] for alt in entry["top_logprobs"]] == kept_ids.tolist()
        assert [alt["logprob"] for alt in entry["top_logprobs"]] == pytest.approx(expected.tolist(),
                                                                                  abs=LOGPROB_TOLERANCE)
        assert math.fsum(math.exp(alt["logprob"]) for alt in entry["top_logprobs"]) == pytest.approx(1.0, abs=1e-3)
        assert entry["token_id"] in kept_ids.tolist()
        assert entry["logprob"] == pytest.approx(float(expected[kept_ids.tolist().index(entry["token_id"])]),
                                                 abs=LOGPROB_TOLERANCE)


def test_logprobs_only_for_the_rows_that_ask(v2):
    with_lp = v2.send({"type": "generate", "prompt": "ROMEO:", "sampling": {"max_tokens": 5, "logprobs": True}})
    without = v2.send({"type": "generate", "prompt": "JULIET:", "sampling": {"max_tokens": 5}})
    final, chunks = v2.collect(with_lp)
    assert all(len(c["logprobs"]) == 1 and c["logprobs"][0]["top_logprobs"] == [] for c in chunks)
    final, chunks = v2.collect(without)
    assert final["type"] == "final" and all(c["logprobs"] is None for c in chunks)


# ---------------------------------------------------------------- n


@pytest.mark.parametrize("prompt_len", [2 * BLOCK - 5, 2 * BLOCK], ids=["partial-block", "full-blocks"])
def test_n_sequences_each_equal_a_single_run_with_their_seed(v2, hf, prompt_len):
    """The forks share the prompt's prefill and KV blocks (a partly filled last block is
    copied): each sequence must equal the same request run alone with its derived seed."""
    _, tokenizer = hf
    ids = tokenizer.encode((EMBEDDED_MODEL / "validation.txt").read_text()[:600])[:prompt_len]
    seed, n = 1234, 4
    sampling = {"max_tokens": 24, "temperature": 1.0, "top_p": 0.95, "seed": seed, "ignore_eos": True}
    final, _ = v2.generate(prompt_token_ids=ids, stream=False, sampling=sampling | {"n": n})
    assert final["type"] == "final", final
    choices = final["choices"]
    assert [c["index"] for c in choices] == list(range(n))
    assert final["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": n * 24}
    assert len({tuple(c["token_ids"]) for c in choices}) == n, "the sequences should differ"
    for i, choice in enumerate(choices):
        alone, _ = v2.generate(prompt_token_ids=ids, stream=False,
                               sampling=sampling | {"seed": derived_seed(seed, i)})
        assert alone["choices"][0]["token_ids"] == choice["token_ids"], f"sequence {i}"
    again, _ = v2.generate(prompt_token_ids=ids, stream=False, sampling=sampling | {"n": n})
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in choices]
    assert v2.request({"type": "status"})["status"]["kv_blocks"]["used"] == 0


def test_greedy_n_sequences_all_equal_the_model(v2, hf):
    model, tokenizer = hf
    ids = tokenizer.encode("HAMLET:\nTo be, or not to be")
    final, _ = v2.generate(prompt_token_ids=ids, stream=False,
                           sampling={"max_tokens": 10, "temperature": 0.0, "n": 3, "logprobs": True})
    expected = hf_logprobs(model, ids, final["choices"][0]["token_ids"])
    for choice in final["choices"]:
        assert choice["token_ids"] == expected.argmax(dim=-1).tolist()
        assert_logprobs_match(choice["logprobs"], expected, choice["token_ids"], top=0)


def test_n_streams_chunks_per_sequence(v2):
    final, chunks = v2.generate(prompt="ROMEO:", sampling={"max_tokens": 7, "seed": 3, "n": 3, "stop": ["\n\n"]})
    assert final["type"] == "final"
    assert {c["index"] for c in chunks} == {0, 1, 2}
    for choice in final["choices"]:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        streamed = [t for c in mine for t in c["token_ids"]]
        assert choice["token_ids"][: len(streamed)] == streamed
    assert final["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in final["choices"])


def test_cancelling_n_sequences_ends_them_all_and_frees_their_blocks(v2):
    rid = v2.send({"type": "generate", "prompt": "ROMEO:",
                   "sampling": {"max_tokens": 500, "ignore_eos": True, "n": 4}})
    first = v2._next_for(rid, deadline=time.monotonic() + 60)
    assert first is not None and first["type"] == "chunk"
    v2.send({"type": "cancel", "target": rid})
    final, _ = v2.collect(rid)
    assert [c["finish_reason"] for c in final["choices"]] == ["cancelled"] * 4
    status = v2.request({"type": "status"})["status"]
    assert status["kv_blocks"]["used"] == 0 and status["requests"]["running"] == 0


def test_a_timeout_ends_n_sequences_with_timeout_and_their_output_so_far(v2):
    """Each sequence's final output (tokens, text, reason) is what it streamed: the one
    record of a sequence, read once for the chunks and once for the final."""
    final, chunks = v2.generate(prompt="ROMEO:", timeout_s=0.5,
                                sampling={"max_tokens": 2000, "ignore_eos": True, "n": 3, "seed": 5})
    assert final["type"] == "final", final
    assert [c["finish_reason"] for c in final["choices"]] == ["timeout"] * 3
    for choice in final["choices"]:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
        assert "".join(c["text"] for c in mine) == choice["text"]
    assert final["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in final["choices"])
    timings = final["timings"]
    assert 0 <= timings["queue_s"] <= timings["total_s"] and timings["total_s"] >= 0.5
    assert timings["ttft_s"] is None or timings["queue_s"] <= timings["ttft_s"] <= timings["total_s"]


# ---------------------------------------------------------------- chat


def test_chat_is_the_prompt_its_template_renders(v2, hf):
    _, tokenizer = hf
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("BENVOLIO:\nSpeak again, bright angel.\n\nJULIET:\n")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    sampling = {"max_tokens": 12, "temperature": 0.0}
    chat, _ = v2.generate(messages=CHAT, sampling=sampling)
    plain, _ = v2.generate(prompt_token_ids=ids, sampling=sampling)
    assert chat["usage"]["prompt_tokens"] == len(ids)
    # The chat may end sooner, at the model's turn end (its chat_stop_strings).
    tokens = chat["choices"][0]["token_ids"]
    assert tokens and tokens == plain["choices"][0]["token_ids"][:len(tokens)]


def test_chat_errors_name_messages(v2):
    reply = v2.request({"type": "generate", "messages": [{"role": "user"}]})
    assert (reply["code"], reply["field"]) == ("invalid_request", "messages[0].content")
    reply = v2.request({"type": "generate", "prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    assert (reply["code"], reply["field"]) == ("invalid_request", "prompt")


def test_a_model_without_a_chat_template_refuses_chats(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "run").mkdir()
    engine = EnginePair(tmp_path / "run", model=str(model_dir), max_batch=2, decode_buckets=[1, 2], **ENGINE)
    try:
        engine.wait_ready()
        client = engine.client(version=2)
        reply = client.request({"type": "generate", "messages": [{"role": "user", "content": "Good morrow."}]})
        assert (reply["type"], reply["code"], reply["field"]) == ("error", "invalid_request", "messages")
        assert "chat template" in reply["message"] and reply["message"].startswith("messages:")
        # n beyond the batch can never run together: refused up front, naming n
        reply = client.request({"type": "generate", "prompt": "ROMEO:", "sampling": {"n": 3}})
        assert (reply["code"], reply["field"]) == ("invalid_request", "sampling.n")
        final, _ = client.generate(prompt="ROMEO:", sampling={"max_tokens": 3, "n": 2})
        assert final["type"] == "final" and len(final["choices"]) == 2  # and the daemon serves on
        client.close()
    finally:
        engine.close()


# ---------------------------------------------------------------- prompt logprobs


def assert_prompt_logprobs_match(entries: list, prompt_ids: list[int], model, top: int) -> None:
    """Each prompt token's entry against the model's own log-softmax at the position before it."""
    with torch.no_grad():
        expected = model(torch.tensor([prompt_ids])).logits[0].float().log_softmax(dim=-1)
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for pos in range(1, len(prompt_ids)):
        entry, row, token = entries[pos], expected[pos - 1], prompt_ids[pos]
        assert entry["token_id"] == token
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=LOGPROB_TOLERANCE), pos
        above = lambda margin: int((row > row[token] + margin).sum())  # noqa: E731
        assert above(LOGPROB_TOLERANCE) + 1 <= entry["rank"] <= above(-LOGPROB_TOLERANCE) + 1, pos
        values = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert values == pytest.approx(row.topk(top).values.tolist(), abs=LOGPROB_TOLERANCE), pos


@pytest.mark.parametrize("length", [9, 100], ids=["one-chunk", "chunks"])
def test_prompt_logprobs_equal_the_models_log_softmax(pair, hf, length):
    """A prompt longer than the step's logits rows (max_batch) is computed in chunks; a
    cached prefix does not stand in for its rows (the same prompt twice); the completion
    is the one without them."""
    model, tokenizer = hf
    text = (EMBEDDED_MODEL / "validation.txt").read_text(encoding="utf-8")
    prompt_ids = tokenizer.encode(text)[:length]
    v4 = pair.client(version=4)
    try:
        plain, _ = v4.generate(prompt_token_ids=prompt_ids, sampling={"max_tokens": 4, "temperature": 0.0})
        for _ in range(2):
            final, _ = v4.generate(prompt_token_ids=prompt_ids,
                                   sampling={"max_tokens": 4, "temperature": 0.0, "prompt_logprobs": 3})
            assert final["type"] == "final", final
            assert_prompt_logprobs_match(final["prompt_logprobs"], prompt_ids, model, 3)
            assert final["usage"]["cached_tokens"] == 0
            assert final["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
        assert plain["prompt_logprobs"] is None
    finally:
        v4.close()
