"""hybridd/bench/random_checkpoint.py names the checkpoints it writes by their shape, so
that a benchmark's table says which model it timed, not the directory it was written to."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.random_checkpoint import ROOT, describe, make_checkpoint

MARKER = "hybridd-random.json"  # what the tool writes beside the weights


def test_a_written_checkpoint_is_named_by_its_shape(tmp_path):
    out = make_checkpoint(tmp_path / "some-dir", "tiny", device="cpu")
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 64
    assert describe(out) == "tiny shape, random weights"


def test_another_directory_is_named_by_its_name(tmp_path):
    model = tmp_path / "my-llama"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert describe(model) == "my-llama"
    (model / MARKER).write_text("not json")
    assert describe(model) == "my-llama"
    (model / MARKER).write_text(json.dumps(["a list"]))
    assert describe(model) == "my-llama"


def test_neither_a_checkpoint_nor_a_name_to_give_is_refused_by_name():
    proc = subprocess.run([sys.executable, "-m", "hybridd.bench.random_checkpoint"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "--out is required (or --describe DIR)" in proc.stderr


def test_a_predictable_checkpoint_continues_each_token_with_its_permuted_one(tmp_path):
    """`--predictable`: transformers' own model, loaded from the checkpoint, follows token t
    with perm[t] (torch.randperm of the vocabulary, seeded by the marker's seed) at every
    position of a random context and through its own greedy continuation."""
    import torch
    from transformers import LlamaForCausalLM

    out = make_checkpoint(tmp_path / "predictable", "tiny", device="cpu", predictable=True)
    marker = json.loads((out / MARKER).read_text())
    assert describe(out) == "tiny shape, random weights made predictable"
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(marker["predictable_seed"]))
    ids = torch.randint(3, vocab, (1, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.equal(logits.argmax(-1), perm[ids[0]])
    top2 = logits.topk(2, dim=-1).values
    # By a margin no rounding flips: the top logit is about 1.3 at this width, the margin about 0.8.
    assert (top2[:, 0] - top2[:, 1]).min() > 0.2
    generated = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 95:]
    assert torch.equal(generated[1:], perm[generated[:-1]])
