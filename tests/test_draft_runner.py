"""The graph generator's draft runner (`DraftRunner`: the draft model through a graph
runner of its own, its KV arena and step buffers; eager on the CPU), asked by the
context generator's side (`GraphDrafter`) with every message through the control
codec: its drafts are the in-process reference's (`DraftModelDrafter`), token for token
and distribution for distribution, greedy and sampled, over verify steps that keep part
of each draft, with a prompt whose catch-up takes several forwards (longer than the
step buffers hold) and with tokens that take several messages. Finished sequences are
let go on both sides; a message out of step gets no drafts, and its sequence is sent
whole the next time."""

from __future__ import annotations

import pytest
import torch

from hybridd.engine.sequence import Sequence
from hybridd.engine.speculation import graph_drafter
from hybridd.engine.speculation.draft_model import DraftModelDrafter
from hybridd.model import load_model
from hybridd.protocol import control
from hybridd.protocol.messages import SamplingParams
from tests.speculation_helpers import ServedDraftModel, build_tiny_draft, repetitive_prompts
from tests.tiny_models import build_tiny_model

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=64, temperature=0.9, top_k=40, top_p=0.95, seed=11, repetition_penalty=1.1,
                         frequency_penalty=0.2, ignore_eos=True)
BLOCK = 8
MAX_TOKENS = 64  # the step buffers' tokens: a longer catch-up takes several forwards


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft-runner")
    target = build_tiny_model("llama3_2", path / "target")
    build_tiny_draft(target, path / "draft", layers=1, noise=0.05)
    return load_model(path / "draft", dtype=torch.float32)


def serve(model, num_blocks: int) -> ServedDraftModel:
    return ServedDraftModel(model, num_blocks, BLOCK, MAX_TOKENS)


def assert_same(got, expected) -> None:
    assert [d.tokens for d in got] == [d.tokens for d in expected]
    for g, e in zip(got, expected, strict=True):
        assert (g.probabilities is None) == (e.probabilities is None)
        if e.probabilities is not None:
            torch.testing.assert_close(g.probabilities, e.probabilities, atol=1e-5, rtol=1e-4)


def verify_rounds(draft, served: ServedDraftModel, rounds: int = 5) -> None:
    """Draft with both drafters for the same sequences; each round the target keeps a
    part of each draft (the first `round % 3` tokens) and draws a token of its own."""
    reference = DraftModelDrafter(draft, 96, BLOCK)
    long_prompt, short_prompt = repetitive_prompts((60, 8), seed=4)  # 150 and 20 tokens
    seqs = [Sequence("long", long_prompt, GREEDY), Sequence("short", short_prompt, SAMPLED),
            Sequence("other", short_prompt[:12], GREEDY)]
    for r in range(rounds):
        counts = [4, 3, 0 if r == 1 else 2]
        got = served.drafter.propose(seqs, counts)
        expected = reference.propose(seqs, counts)
        assert_same(got, expected)
        assert [len(d) for d in got] == counts
        for seq, d in zip(seqs, got, strict=True):
            kept = d.tokens[:r % 3]
            seq.output_token_ids += kept + [(kept[-1] if kept else seq.token_ids[-1]) % 300 + 3]


def test_drafts_equal_the_in_process_reference_greedy_and_sampled(draft):
    served = serve(draft, 96)
    verify_rounds(draft, served)
    # The long prompt's first catch-up took several forwards; decode steps replayed graphs.
    stats = served.runner.runner.stats
    assert sum(s.replays for (kind, _), s in stats.items() if kind == "decode") > 0
    assert served.runner.drafts > 0
    # Each sequence's tokens went once: after the first message only what was added.
    later = [s for m in served.messages[1:] for s in m.sequences]
    assert later and all(s.first > 0 and s.params is None and len(s.tokens) <= 3 for s in later)
    # A finished sequence is let go on both sides with the next message.
    served.drafter.release("long")
    served.drafter.propose([Sequence("new", [5, 6, 7], GREEDY)], [2])
    assert served.messages[-1].released == ["long"]
    assert "long" not in served.runner.sequences and "long" not in served.runner.drafter.cache.seqs


def test_many_finished_sequences_are_let_go_without_an_answer(draft, monkeypatch):
    monkeypatch.setattr(graph_drafter, "MAX_RELEASED", 2)
    served = serve(draft, 96)
    seqs = [Sequence(str(i), [5 + i, 6, 7], GREEDY) for i in range(3)]
    served.drafter.propose(seqs, [2, 2, 2])
    served.drafter.release("0")
    served.drafter.release("1")  # told at once, in a message that asks for nothing
    assert served.messages[-1].released == ["0", "1"] and not served.messages[-1].sequences
    assert set(served.runner.sequences) == {"2"} and set(served.runner.drafter.cache.seqs) == {"2"}


def test_tokens_past_a_message_take_several(draft, monkeypatch):
    monkeypatch.setattr(graph_drafter, "MAX_TOKENS_PER_MESSAGE", 50)
    served = serve(draft, 96)
    verify_rounds(draft, served, rounds=2)
    first = served.messages[:4]
    assert all(sum(len(s.tokens) for s in m.sequences) <= 50 for m in served.messages)
    assert [s.count for s in first[0].sequences] == [0]  # tokens only, before the message that asks
    assert len(served.messages) > 2


def test_a_message_out_of_step_gets_no_drafts_and_the_sequence_is_sent_whole_next(draft):
    served = serve(draft, 96)
    seq = Sequence("s", repetitive_prompts((10,), seed=3)[0], GREEDY)
    assert len(served.drafter.propose([seq], [3])[0]) == 3
    stray = control.Draft(draft=99, sequences=[control.DraftSequence(request_id="s", first=3, tokens=[4], count=2)])
    assert served.runner.draft(stray).failed and "s" not in served.runner.sequences
    # The context generator's side still thinks the tokens were sent: the runner says it
    # failed, and the next message sends the sequence whole.
    seq.output_token_ids.append(9)
    assert served.drafter.propose([seq], [3])[0].tokens == []
    again = served.drafter.propose([seq], [3])[0]
    assert served.messages[-1].sequences[0].first == 0 and len(again) == 3
    assert again.tokens == DraftModelDrafter(draft, 96, BLOCK).propose([seq], [3])[0].tokens


def test_a_sequence_that_does_not_fit_the_draft_cache_gets_no_draft(draft):
    served = serve(draft, 4)  # 32 tokens of KV
    short, long = Sequence("short", [5, 6, 7, 8], GREEDY), Sequence("long", list(range(3, 43)), GREEDY)
    drafts = served.drafter.propose([short, long], [3, 3])
    assert len(drafts[0]) == 3 and drafts[1].tokens == []
    assert "long" not in served.runner.drafter.cache.seqs
