"""The model runtime against transformers itself, on the CPU in float32."""

from __future__ import annotations

import pytest
import torch

from hybridd.model import KVCache, StepInputs, load_model
from hybridd.engine.generate import greedy_generate

REL_TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ours = load_model(tiny_model_dir, dtype=torch.float32)
    return ref, ours


def prompts(n: int, seed: int = 1, lo: int = 3, hi: int = 45) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 320, (L,), generator=g).tolist() for L in lengths]


@torch.inference_mode()
def reference_greedy(ref, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with transformers, re-running the full sequence each step (no cache)."""
    ids = list(prompt)
    logits_seq = []
    for _ in range(n):
        logits = ref(torch.tensor([ids])).logits[0, -1]
        logits_seq.append(logits)
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :], logits_seq


@torch.inference_mode()
def test_prefill_logits_match_every_position(pair):
    ref, ours = pair
    prompt = prompts(1, seed=7, lo=40, hi=41)[0]
    expected = ref(torch.tensor([prompt])).logits[0]
    kv = KVCache.allocate(ours.config, 8, 16, torch.float32, "cpu")
    step = StepInputs.prefill([prompt], [[3, 0, 5]], 16)  # non-contiguous blocks on purpose
    got = ours.compute_logits(ours(step, kv))
    assert got.shape == expected.shape
    assert rel_err(got, expected) <= REL_TOL
    assert expected.std() > 0.1  # logits are far from uniform: the comparison has teeth


@torch.inference_mode()
def test_decode_step_logits_match(pair):
    ref, ours = pair
    prompt = prompts(1, seed=3, lo=10, hi=11)[0]
    tokens, ref_logits = reference_greedy(ref, prompt, 12)
    bs = 4  # small blocks: decode crosses several block boundaries
    table = [9, 2, 7, 4, 0, 11]
    kv = KVCache.allocate(ours.config, 12, bs, torch.float32, "cpu")
    got = ours.forward_logits(StepInputs.prefill([prompt], [table], bs), kv)[0]
    assert rel_err(got, ref_logits[0]) <= REL_TOL
    for i in range(1, 12):
        step = StepInputs.decode([tokens[i - 1]], [len(prompt) + i - 1], [table], bs)
        got = ours.forward_logits(step, kv)[0]
        assert rel_err(got, ref_logits[i]) <= REL_TOL, f"decode step {i}"


def test_greedy_continuations_identical_for_32_tokens(pair):
    ref, ours = pair
    batch = prompts(4, seed=11)
    ours_out = greedy_generate(ours, batch, 32, block_size=8)
    for prompt, got in zip(batch, ours_out, strict=True):
        expected, _ = reference_greedy(ref, prompt, 32)
        assert got == expected


@torch.inference_mode()
def test_batch_of_different_lengths_equals_each_alone(pair):
    _, ours = pair
    batch = prompts(5, seed=5, lo=2, hi=40)
    together = greedy_generate(ours, batch, 20, block_size=8)
    for prompt, got in zip(batch, together, strict=True):
        assert greedy_generate(ours, [prompt], 20, block_size=8)[0] == got

    # Logits, not only tokens: the batched prefill rows equal the single-sequence rows.
    kv = KVCache.allocate(ours.config, 40, 8, torch.float32, "cpu")
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(batch))]
    joint = ours.forward_logits(StepInputs.prefill(batch, tables, 8), kv)
    for i, prompt in enumerate(batch):
        alone = ours.forward_logits(StepInputs.prefill([prompt], [tables[i]], 8), kv)
        assert rel_err(joint[i], alone[0]) <= 1e-5


@torch.inference_mode()
def test_block_size_does_not_change_results(pair):
    _, ours = pair
    batch = prompts(3, seed=21, lo=15, hi=35)
    outs = [greedy_generate(ours, batch, 24, block_size=bs) for bs in (1, 4, 16, 64)]
    assert all(o == outs[0] for o in outs)


@torch.inference_mode()
def test_padding_slot_writes_nothing(pair):
    _, ours = pair
    kv = KVCache.allocate(ours.config, 4, 8, torch.float32, "cpu")
    kv.arena.normal_()
    before = kv.arena[:, :, : kv.num_blocks].clone()
    step = StepInputs.prefill([[5, 6, 7]], [[0]], 8)
    step.slot_mapping.fill_(-1)
    ours(step, kv)
    assert torch.equal(kv.arena[:, :, : kv.num_blocks], before)
