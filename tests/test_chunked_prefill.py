"""Chunked prefill end to end on the real model (fp32, CPU): the tokens are those of the
transformers model's own greedy decoding, whether prompts run whole or in chunks of a
small budget beside decoding streams — multi-turn, prompts that differ in one token,
n > 1, preemption under KV pressure, and a prompt at max_model_len."""

from __future__ import annotations

import pytest
import torch

from hybridd.engine.block_manager import BlockManager
from hybridd.engine.core import EngineCore
from hybridd.engine.in_process_runner import InProcessRunner
from hybridd.engine.scheduler import Scheduler
from hybridd.model import KVCache, load_model
from hybridd.protocol.messages import SamplingParams

pytestmark = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)


def run_engine(model, prompts, max_tokens, budget, num_blocks=96, block_size=4, n=1, max_batch=8):
    kv = KVCache.allocate(model.config, num_blocks, block_size, model.dtype, model.device)
    sched = Scheduler(BlockManager(num_blocks, block_size, watermark=0.0, enable_prefix_caching=False), max_batch,
                      budget, model.max_positions)
    core = EngineCore(sched, InProcessRunner(model, kv), pipeline_depth=1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
    requests = [core.add(str(i), p, params) for i, p in enumerate(prompts)]
    while core.has_work:
        core.step()
    return [[s.output_token_ids for s in r.seqs] for r in requests], sched


def hf_greedy(tiny_model_dir, prompt, max_tokens):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def model(tiny_model_dir):
    return load_model(tiny_model_dir, dtype=torch.float32, device="cpu", max_positions=160)


def test_chunked_prompts_match_whole_ones_and_the_reference(model, tiny_model_dir):
    g = torch.Generator().manual_seed(0)
    base = torch.randint(4, 300, (70,), generator=g).tolist()
    prompts = [base, base[:-1] + [base[-1] + 1], base[:9], torch.randint(4, 300, (33,), generator=g).tolist()]
    whole, _ = run_engine(model, prompts, 8, budget=512)
    chunked, sched = run_engine(model, prompts, 8, budget=12)
    assert chunked == whole
    assert sched.stats.chunked_prefill_steps > 3 and sched.stats.mixed_steps > 0
    assert whole[0][0] == hf_greedy(tiny_model_dir, prompts[0], 8)
    assert whole[1][0] == hf_greedy(tiny_model_dir, prompts[1], 8)


def test_multi_turn_n_and_a_prompt_at_max_model_len(model, tiny_model_dir):
    g = torch.Generator().manual_seed(1)
    first = torch.randint(4, 300, (40,), generator=g).tolist()
    (turn1,), _ = run_engine(model, [first], 6, budget=16)
    second = first + turn1[0] + torch.randint(4, 300, (25,), generator=g).tolist()
    longest = torch.randint(4, 300, (model.max_positions - 4,), generator=g).tolist()
    chunked, _ = run_engine(model, [second, longest], 4, budget=16, n=2, num_blocks=200)
    whole, _ = run_engine(model, [second, longest], 4, budget=1024, n=2, num_blocks=200)
    assert chunked == whole
    assert chunked[0][0] == chunked[0][1] == hf_greedy(tiny_model_dir, second, 4)
    assert chunked[1][0] == hf_greedy(tiny_model_dir, longest, 4)


def test_chunked_prefill_under_preemption(model):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 300, (int(n),), generator=g).tolist() for n in (30, 45, 12, 38, 20)]
    whole, _ = run_engine(model, prompts, 12, budget=1024, num_blocks=200)
    chunked, sched = run_engine(model, prompts, 12, budget=10, num_blocks=36)
    assert sched.num_preemptions > 0
    assert chunked == whole


def test_prompt_logprobs_in_chunks_beside_decoding_streams(model, tiny_model_dir):
    """A prompt that asks for its logprobs, in chunks of a small budget (chunk_tokens)
    beside streams that decode: each prompt token's entry is the transformers model's
    log-softmax at the position before it."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 300, (int(n),), generator=g).tolist() for n in (9, 70, 14)]
    kv = KVCache.allocate(model.config, 40, 4, model.dtype, model.device)
    sched = Scheduler(BlockManager(40, 4, watermark=0.0), 8, 10, model.max_positions)
    core = EngineCore(sched, InProcessRunner(model, kv), pipeline_depth=1)
    streams = [core.add(f"s{i}", p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
               for i, p in enumerate((prompts[0], prompts[2]))]
    core.step()  # the streams are decoding when the long prompt arrives
    asked = core.add("asked", prompts[1], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2))
    while core.has_work:
        core.step()
    assert sched.stats.chunked_prefill_steps > 3 and sched.stats.mixed_steps > 0
    assert all(len(s.seqs[0].output_token_ids) == 20 for s in streams)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([prompts[1]])).logits[0].log_softmax(dim=-1)
    entries = asked.seqs[0].prompt_logprobs
    assert len(entries) == len(prompts[1]) and entries[0] is None
    for pos in range(1, len(prompts[1])):
        token = prompts[1][pos]
        assert entries[pos].token_id == token
        assert entries[pos].logprob == pytest.approx(float(expected[pos - 1][token]), abs=1e-4), pos
        top = [alt.logprob for alt in entries[pos].top_logprobs]
        assert top == pytest.approx(expected[pos - 1].topk(2).values.tolist(), abs=1e-4), pos
