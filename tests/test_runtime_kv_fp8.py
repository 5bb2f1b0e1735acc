"""`kv_cache_dtype = "fp8"` against the two real worker processes: the pair serves the
embedded model token for token as the model decodes in-process over an FP8 cache (no
prefix cache, no forks there), with forks (`n > 1`: the prompt's partly filled last
block copied with its scales) and with prefix-cache hits (cached blocks read with their
scales); status names the KV dtype, and the same KV budget holds more blocks."""

from __future__ import annotations

import pytest
import torch

from hybridd.cli import format_status
from hybridd.config import EMBEDDED_MODEL
from hybridd.engine.generate import greedy_generate
from hybridd.model import load_model, load_tokenizer
from hybridd.model.config import ModelConfig
from hybridd.model.kv_cache import kv_bytes_per_block
from tests.engine_pair import EnginePair
from tests.host_load import on_this_host

pytestmark = pytest.mark.slow
BLOCK = 16  # the default block_size
CPU_DEFAULT_KV_BLOCKS = 512  # the graph generator's KV budget on the CPU, in model-dtype blocks
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with EnginePair(tmp_path_factory.mktemp("run"), device="cpu", dtype="float32", kv_cache_dtype="fp8") as engine:
        yield engine


@pytest.fixture(scope="module")
def expected():
    """Prompts (a partly filled last block; two full blocks and a part) and their greedy
    tokens in-process over an FP8 cache."""
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    text = tokenizer.encode((EMBEDDED_MODEL / "validation.txt").read_text()[:600])
    prompts = [text[:BLOCK + 5], text[100:100 + 2 * BLOCK + 7]]
    model = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    return prompts, greedy_generate(model, prompts, MAX_TOKENS, kv_dtype=torch.float8_e4m3fn)


def generate(client, prompt, salt=None, **sampling):
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    fields = {} if salt is None else {"cache_salt": salt}
    final, _ = client.generate(timeout=on_this_host(60), prompt_token_ids=prompt, stream=False,
                               sampling=greedy | sampling, **fields)
    assert final["type"] == "final", final
    return final


def test_fp8_pair_serves_the_fp8_model_and_reports_its_kv_dtype_and_blocks(pair, expected):
    prompts, fp8 = expected
    client = pair.client(version=3)
    try:
        for prompt, tokens in zip(prompts, fp8, strict=True):
            assert generate(client, prompt)["choices"][0]["token_ids"] == tokens
        status = client.request({"type": "status"}, timeout=on_this_host(30))["status"]
    finally:
        client.close()
    assert status["kv_cache_dtype"] == "float8_e4m3fn" and status["dtype"] == "float32"
    assert "kv float8_e4m3fn" in format_status(status)
    # The CPU's KV budget (512 float32 blocks' bytes) in FP8 blocks with their scales:
    # 64 + 4 bytes a head vector instead of 256 (bfloat16's 128 would give 1.88 times).
    config = ModelConfig.from_dir(EMBEDDED_MODEL)
    fp8_block, f32_block = (kv_bytes_per_block(config, BLOCK, dt) for dt in (torch.float8_e4m3fn, torch.float32))
    assert status["kv_blocks"]["total"] == CPU_DEFAULT_KV_BLOCKS * f32_block // fp8_block
    assert status["kv_blocks"]["total"] > 3.5 * CPU_DEFAULT_KV_BLOCKS


def test_forks_and_prefix_cache_hits_read_the_blocks_with_their_scales(pair, expected):
    """n = 3 forks of a prompt whose last block is partly filled (copied to each fork with
    its scales), then the same prompts again (their full blocks now cached, read back
    with their scales) under one salt: every sequence equals the in-process FP8 model's,
    which has neither forks nor a prefix cache."""
    prompts, fp8 = expected
    client = pair.client(version=3)
    try:
        forked = generate(client, prompts[0], n=3)
        assert [c["token_ids"] for c in forked["choices"]] == [fp8[0]] * 3
        for prompt, tokens in zip(prompts, fp8, strict=True):
            cold = generate(client, prompt, salt="fp8-kv")
            warm = generate(client, prompt, salt="fp8-kv")
            assert warm["usage"]["cached_tokens"] == len(prompt) // BLOCK * BLOCK > 0
            assert cold["choices"][0]["token_ids"] == warm["choices"][0]["token_ids"] == tokens
        warm_forks = generate(client, prompts[1], n=2, salt="fp8-kv")
        assert [c["token_ids"] for c in warm_forks["choices"]] == [fp8[1]] * 2
    finally:
        client.close()
