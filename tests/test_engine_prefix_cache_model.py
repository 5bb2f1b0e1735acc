"""The prefix cache over the real model (CPU, float32): the engine core with and without
it gives token-identical outputs, greedy ones equal to transformers' own, while later
requests prefill only what the cache does not hold."""

from __future__ import annotations

import pytest
import torch

from hybridd.engine.block_manager import BlockManager
from hybridd.engine.core import EngineCore
from hybridd.engine.in_process_runner import InProcessRunner
from hybridd.engine.scheduler import Scheduler
from hybridd.model import KVCache, load_model
from hybridd.protocol.messages import SamplingParams

BLOCK = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return ref, load_model(tiny_model_dir, dtype=torch.float32)


@torch.inference_mode()
def reference_greedy(ref, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


class Engine:
    """One engine core over the model whose KV cache outlives its requests, as the daemon's."""

    def __init__(self, model, caching: bool, num_blocks: int = 96, max_batch: int = 4, max_model_len: int = 256):
        kv = KVCache.allocate(model.config, num_blocks, BLOCK, torch.float32, "cpu")
        self.blocks = BlockManager(num_blocks, BLOCK, watermark=0.0, enable_prefix_caching=caching)
        scheduler = Scheduler(self.blocks, max_batch=max_batch, max_prefill_tokens=512, max_model_len=max_model_len,
                              eos_token_ids=model.config.eos_token_ids)
        self.core = EngineCore(scheduler, InProcessRunner(model, kv), pipeline_depth=1)
        self._ids = 0

    def run(self, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
        """Run the prompts together to their ends; the requests' sequences."""
        requests = []
        for prompt in prompts:
            self._ids += 1
            requests.append(self.core.add(f"r{self._ids}", prompt, params))
        while self.core.has_work:
            self.core.step()
        return [request.seqs for request in requests]


def both(model, script, **engine):
    """`script(engine)` with the prefix cache and without; both engines' results."""
    cached, plain = Engine(model, True, **engine), Engine(model, False, **engine)
    return script(cached), script(plain), cached, plain


def outputs(requests) -> list[list[list[int]]]:
    return [[seq.output_token_ids for seq in seqs] for seqs in requests]


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_multi_turn_chat(pair):
    ref, model = pair

    def chat(engine: Engine) -> list[list[int]]:
        history, turns = prompt(1, 13), []
        for turn in range(4):
            (seq,), = engine.run([history])
            turns.append((list(history), seq.output_token_ids, seq.num_cached_tokens))
            history = seq.token_ids + prompt(100 + turn, 7)
        return turns

    cached, plain, engine, _ = both(model, chat)
    assert [t[:2] for t in cached] == [t[:2] for t in plain]
    for history, output, hit in cached:
        assert output == reference_greedy(ref, history, GREEDY.max_tokens)
    assert [hit for *_, hit in cached][1:] == [(len(h) - 7 - 1) // BLOCK * BLOCK for h, *_ in cached[1:]]
    assert engine.blocks.prefix_cache_hits == sum(hit for *_, hit in cached) > 0


def test_prompts_sharing_all_but_one_token(pair):
    ref, model = pair
    base = prompt(2, 22)
    variants = [base + [7 + i] for i in range(3)]

    def script(engine: Engine):
        return engine.run(variants[:1]) + engine.run(variants[1:])

    cached, plain, _, _ = both(model, script)
    assert outputs(cached) == outputs(plain)
    assert [seqs[0].num_cached_tokens for seqs in cached] == [0, 20, 20]
    for variant, seqs in zip(variants, cached):
        assert seqs[0].output_token_ids == reference_greedy(ref, variant, GREEDY.max_tokens)


def test_a_cached_prefix_evicted_mid_run(pair):
    _, model = pair
    shared = prompt(3, 24)
    crowd = [prompt(10 + i, 17) for i in range(4)]

    def script(engine: Engine):
        first = engine.run([shared + [5]])
        # the crowd's blocks push the prefix out while they run; then it is asked for again
        middle = engine.run(crowd, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        return first + middle + engine.run([shared + [6]])

    cached, plain, _, _ = both(model, script, num_blocks=24)
    assert outputs(cached) == outputs(plain)
    assert cached[-1][0].num_cached_tokens < 24


def test_n_sequences_of_a_cached_prompt(pair):
    _, model = pair
    text = prompt(4, 18)
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=11, n=3, ignore_eos=True)

    def script(engine: Engine):
        return engine.run([text], params) + engine.run([text], params)

    cached, plain, _, _ = both(model, script)
    assert outputs(cached) == outputs(plain)
    assert outputs(cached)[0] == outputs(cached)[1]  # seeded: the hit changes nothing
    assert [seq.num_cached_tokens for seq in cached[1]] == [16] * 3


def test_preemption_under_kv_pressure(pair):
    _, model = pair
    texts = [prompt(20 + i, 9 + i) for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def script(engine: Engine):
        return engine.run(texts, params)

    cached, plain, engine, _ = both(model, script, num_blocks=22, max_batch=6)
    assert engine.core.scheduler.num_preemptions > 0
    assert outputs(cached) == outputs(plain)


def test_prompts_at_max_model_len(pair):
    ref, model = pair
    text = prompt(5, 47)

    def script(engine: Engine):
        return engine.run([text]) + engine.run([text])

    cached, plain, _, _ = both(model, script, max_model_len=48)
    assert outputs(cached) == outputs(plain) == [[reference_greedy(ref, text, 1)]] * 2
    assert cached[1][0].num_cached_tokens == 44
