"""The host-side step description against its definition: every field of a prefill,
for prompts of any length and start, over block tables of any layout."""

import random

import numpy as np
import pytest

from hybridd.model.step_inputs import HostStepInputs, StepInputs

DTYPES = {"input_ids": np.int64, "positions": np.int64, "slot_mapping": np.int64, "block_tables": np.int32,
          "seq_lens": np.int32, "query_start_loc": np.int32, "logits_indices": np.int64}


def expected_prefill(prompts, tables, block_size, starts, width):
    """Each field spelled out token by token from its definition in `StepFields`."""
    ids, positions, slots, lens, qsl, last = [], [], [], [], [0], []
    for prompt, table, start in zip(prompts, tables, starts):
        for i, token in enumerate(prompt):
            p = start + i
            ids.append(token)
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        lens.append(start + len(prompt))
        qsl.append(qsl[-1] + len(prompt))
        last.append(qsl[-1] - 1)
    padded = [list(t) + [0] * (width - len(t)) for t in tables]
    return {"input_ids": ids, "positions": positions, "slot_mapping": slots, "block_tables": padded,
            "seq_lens": lens, "query_start_loc": qsl, "logits_indices": last}


@pytest.mark.parametrize("seed", range(40))
def test_a_prefill_is_its_definition(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 8, 16, 32])
    n = rng.randint(1, 6)
    free = list(range(2000))
    rng.shuffle(free)  # blocks in no order, as a block manager hands them out
    prompts, tables, starts = [], [], []
    for _ in range(n):
        start = rng.choice([0, 0, rng.randint(0, 70)])
        length = rng.randint(1, 130)
        needed = -(-(start + length) // block_size)
        tables.append([free.pop() for _ in range(needed + rng.choice([0, 0, 2]))])
        prompts.append([rng.randrange(32000) for _ in range(length)])
        starts.append(start)
    width = max(len(t) for t in tables) + rng.choice([0, 3])
    step = HostStepInputs.prefill(prompts, tables, block_size, starts, table_width=width)
    want = expected_prefill(prompts, tables, block_size, starts, width)
    for name, dtype in DTYPES.items():
        got = getattr(step, name)
        assert got.dtype == dtype, name
        assert got.tolist() == want[name], name
    assert step.is_prefill and step.num_tokens == sum(map(len, prompts)) and step.num_seqs == n
    # The tensors a forward in this process reads are the same values.
    tensors = step.on("cpu")
    assert isinstance(tensors, StepInputs) and tensors.slot_mapping.tolist() == want["slot_mapping"]


def test_whole_prompts_start_at_position_zero():
    step = HostStepInputs.prefill([[5, 6, 7], [8]], [[3, 4], [9]], 2)
    assert step.positions.tolist() == [0, 1, 2, 0]
    assert step.slot_mapping.tolist() == [6, 7, 8, 18]  # block 3's two slots, block 4's first, block 9's first
    assert step.block_tables.tolist() == [[3, 4], [9, 0]]
    assert step.seq_lens.tolist() == [3, 1] and step.logits_indices.tolist() == [2, 3]


def test_a_table_too_short_for_its_tokens_is_refused_by_row():
    with pytest.raises(ValueError, match=r"block_tables\[1\] holds 1 blocks of 4 tokens, too few for its tokens "
                                         r"up to position 5"):
        HostStepInputs.prefill([[1, 2], [3, 4, 5, 6, 7, 8]], [[0], [1]], 4)


@pytest.mark.parametrize("start", [0, 3, 4, 5, 11])
def test_one_prompts_tail_takes_its_run_of_slots(start):
    """One sequence, its tokens from `start` on (a recompute's or a prefix's tail)."""
    table = [9, 2, 7, 5]
    step = HostStepInputs.prefill([[1] * (16 - start)], [table], 4, [start], table_width=6)
    assert step.positions.tolist() == list(range(start, 16))
    assert step.slot_mapping.tolist() == [table[p // 4] * 4 + p % 4 for p in range(start, 16)]
    assert step.seq_lens.tolist() == [16] and step.block_tables.tolist() == [table + [0, 0]]


@pytest.mark.parametrize("seed", range(20))
def test_one_prompt_is_its_definition(seed):
    """One prompt's step (a new request on an idle daemon; its slots are a run of its
    blocks', without the per-token gather): the definition's fields, any start, block
    size and table width."""
    rng = random.Random(1000 + seed)
    block_size = rng.choice([1, 4, 16, 32])
    start = rng.choice([0, 0, rng.randint(0, 70)])
    prompt = [rng.randrange(32000) for _ in range(rng.randint(1, 130))]
    free = list(range(500))
    rng.shuffle(free)
    table = [free.pop() for _ in range(-(-(start + len(prompt)) // block_size) + rng.choice([0, 2]))]
    width = rng.choice([None, len(table) + 3])
    step = HostStepInputs.prefill([prompt], [table], block_size, [start] if start else None, table_width=width)
    want = expected_prefill([prompt], [table], block_size, [start], width or len(table))
    for name, dtype in DTYPES.items():
        got = getattr(step, name)
        assert got.dtype == dtype and got.tolist() == want[name], name
    with pytest.raises(ValueError, match=r"block_tables\[0\] holds"):
        HostStepInputs.prefill([prompt], [table[:-(-(start + len(prompt)) // block_size) - 1]], block_size,
                               [start], table_width=width)
