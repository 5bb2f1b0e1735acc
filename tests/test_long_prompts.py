"""Prompts up to max_model_len through the two real worker processes on the CPU: a model
whose positions reach far past the prefill token budget takes a prompt at its limit in
chunks, through step buffers sized for the budget, with the transformers model's own
greedy tokens; a prompt past the limit is refused, naming it."""

from __future__ import annotations

import shutil

import pytest
import torch

from hybridd.config import EMBEDDED_MODEL
from hybridd.runtime.step_buffers import geometry
from tests.engine_pair import EnginePair
from tests.host_load import on_this_host
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 4096
BUDGET = 256


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """A tiny Llama whose positions reach 4,096, with the embedded model's tokenizer."""
    path = tmp_path_factory.mktemp("long-llama")
    build_tiny_model("llama", path, max_position_embeddings=MAX_MODEL_LEN)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, path / name)
    return path


def test_step_buffers_hold_a_step_not_a_sequence():
    assert geometry(BUDGET, 32, 32768, 16) == (BUDGET, 2048)  # block tables still span max_model_len
    assert geometry(16, 32, 8192, 16) == (32, 512)  # a full batch of decode rows


def test_a_prompt_at_max_model_len_runs_in_chunks_and_one_past_it_is_refused(tmp_path, long_model_dir):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    max_tokens = 6
    prompt = torch.randint(4, 300, (MAX_MODEL_LEN - max_tokens,), generator=g).tolist()
    reference = AutoModelForCausalLM.from_pretrained(long_model_dir, dtype=torch.float32).eval()
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens)
    expected = out[0, len(prompt):].tolist()
    buckets = [16, 32, 64, 128, BUDGET]
    with EnginePair(tmp_path, model=str(long_model_dir), device="cpu", dtype="float32",
                    max_prefill_tokens=BUDGET, prefill_buckets=buckets) as engine:
        client = engine.client()
        try:
            final, _ = client.generate(timeout=on_this_host(300), prompt_token_ids=prompt,
                                       sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
            assert final["type"] == "final", final
            assert final["token_ids"] == expected
            assert final["finish_reason"] == "length"
            reply = client.request({"type": "generate", "prompt_token_ids": prompt + [5] * max_tokens,
                                    "sampling": {"max_tokens": 1}})
            assert reply["type"] == "error" and reply["code"] == "invalid_request", reply
            assert f"{MAX_MODEL_LEN} tokens; max_model_len is {MAX_MODEL_LEN}" in reply["message"]
        finally:
            client.close()
