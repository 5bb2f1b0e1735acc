"""The graph generator's EAGLE-3 head (`eagle3_runner`: the head through a graph runner
of its own, its KV arena and step buffers; eager on the CPU, in float32), fed the rows
of the target's hidden states that each `Step` names and asked by the context
generator's side (`GraphDrafter`), every message through the control codec: its drafts
are the in-process reference's (`Eagle3Drafter` over `EagerHeadForward`), token for
token, greedy and seeded, over verify steps that keep part of each draft, with a
prompt whose catch-up takes several forwards (longer than the step buffers hold), rows
whose token the context generator did not have yet (-1) and a fork. Finished sequences
are let go on both sides; a `Step` that names rows past its own is logged, and its
sequences draft again once new states come."""

from __future__ import annotations

import pytest
import torch

from hybridd.engine.sequence import Sequence
from hybridd.engine.speculation.eagle3 import Eagle3Drafter
from hybridd.model import load_model
from hybridd.model.eagle3 import load_eagle3_head
from hybridd.protocol import control
from hybridd.protocol.messages import SamplingParams
from tests.eagle3_reference import ReferenceEagle3, head_config, target_aux
from tests.speculation_helpers import ServedEagle3
from tests.tiny_models import build_tiny_model

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=64, temperature=0.9, top_k=40, seed=11, ignore_eos=True)
BLOCK = 8
MAX_TOKENS = 64  # the step buffers' tokens: a longer catch-up takes several forwards


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3-runner")
    hf = build_tiny_model("llama3_2", path / "target", num_hidden_layers=7).eval()
    torch.manual_seed(2)
    d2t = torch.arange(192) * 5 % 320 - torch.arange(192)
    ReferenceEagle3(head_config(hf.config, hidden=48, heads=4, kv_heads=2, draft_vocab=192), d2t=d2t).save_head(
        path / "head")
    target = load_model(path / "target", dtype=torch.float32)
    return {"hf": hf, "head": load_eagle3_head(path / "head", target.config, path / "target", target.embed_tokens)}


class Target:
    """The target's side of the rounds: it processes rows and hands their hidden states
    to both drafters, the reference directly and the served one through a `Step`."""

    def __init__(self, hf, reference: Eagle3Drafter, served: ServedEagle3) -> None:
        self.hf, self.reference, self.served = hf, reference, served

    def process(self, seq: Sequence, start: int, rows: list[int], unknown_first: bool = False) -> None:
        """The target ran `rows` of `seq` from position `start` (the tokens before are the sequence's)."""
        states = target_aux(self.hf, seq.token_ids[:start] + rows)[start:]
        self.reference.observe(seq.request_id, start, rows, states)
        named = [-1, *rows[1:]] if unknown_first else rows  # a decode row's token still on the device
        self.served.observe([control.HiddenRows(request_id=seq.request_id, start=start, row=3, tokens=named)],
                            torch.cat([torch.zeros(3, states.shape[1]), states]))


def test_drafts_equal_the_in_process_reference(setup):
    head = setup["head"]
    reference, served = Eagle3Drafter(head, 64, BLOCK), ServedEagle3(head, 64, BLOCK, MAX_TOKENS)
    target = Target(setup["hf"], reference, served)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (150, 20, 12)]
    seqs = [Sequence("long", prompts[0], GREEDY), Sequence("short", prompts[1], SAMPLED),
            Sequence("other", prompts[2], GREEDY)]
    for seq in seqs:
        target.process(seq, 0, seq.prompt_token_ids)
        seq.output_token_ids.append(seq.prompt_token_ids[-1] % 300 + 3)
    for r in range(5):
        counts = [4, 3, 0 if r == 1 else 2]
        got = served.drafter.propose(seqs, counts)
        expected = reference.propose(seqs, counts)
        assert [d.tokens for d in got] == [d.tokens for d in expected]
        assert [len(d) for d in got] == counts and all(d.probabilities is None for d in got)
        for seq, draft in zip(seqs, got, strict=True):
            # The verify step: the last token and the draft; part of the draft is kept.
            n = len(seq)
            target.process(seq, n - 1, [seq.token_ids[-1], *draft.tokens], unknown_first=r % 2 == 1)
            kept = draft.tokens[:r % 3]
            seq.output_token_ids += kept + [(kept[-1] if kept else seq.token_ids[-1]) % 300 + 3]
    stats = served.runner.runner.stats
    assert sum(s.replays for (kind, _), s in stats.items() if kind == "decode") > 0
    assert served.runner.drafts > 0
    # A fork shares its parent's states; its drafts are its parent's.
    child = Sequence("child", seqs[2].prompt_token_ids, GREEDY)
    child.output_token_ids = list(seqs[2].output_token_ids)
    reference.fork("other", "child")
    served.observe([], torch.zeros(1, 192), [control.Fork(parent="other", child="child")])
    assert served.drafter.propose([child], [3])[0].tokens == reference.propose([child], [3])[0].tokens
    # A finished sequence is let go on both sides with the next message.
    served.drafter.release("long")
    served.drafter.propose([seqs[1]], [2])
    assert served.messages[-1].released == ["long"]
    assert "long" not in served.runner.sequences and "long" not in served.runner.drafter.tracks


def test_a_sequence_only_observed_is_let_go_too(setup):
    """A sequence the head kept states of but never drafted for is let go when it finishes."""
    served = ServedEagle3(setup["head"], 16, BLOCK, MAX_TOKENS)
    seq = Sequence("quiet", [5, 6, 7, 8], GREEDY)
    served.observe([control.HiddenRows(request_id="quiet", start=0, row=0, tokens=[5, 6, 7, 8])],
                   torch.randn(4, 192))
    assert "quiet" in served.runner.drafter.tracks
    served.drafter.release(seq.request_id)
    served.drafter.propose([Sequence("next", [5, 6], GREEDY)], [1])
    assert served.messages[-1].released == ["quiet"] and "quiet" not in served.runner.drafter.tracks


def test_rows_named_past_the_step_are_not_kept_and_the_sequence_drafts_again(setup):
    served = ServedEagle3(setup["head"], 16, BLOCK, MAX_TOKENS)
    seq = Sequence("s", [5, 6, 7, 8], GREEDY)
    rows = [control.HiddenRows(request_id="s", start=0, row=2, tokens=[5, 6, 7])]
    served.observe(rows, torch.randn(4, 192))  # rows 2..4 of a step of 4
    assert "s" not in served.runner.drafter.tracks
    assert served.drafter.propose([seq], [2])[0].tokens == []
    served.observe([control.HiddenRows(request_id="s", start=0, row=0, tokens=[5, 6, 7])], torch.randn(4, 192))
    assert len(served.drafter.propose([seq], [2])[0]) == 2
