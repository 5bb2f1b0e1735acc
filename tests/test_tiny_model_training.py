"""End-to-end smoke test of ``scripts/train_tiny.py`` (the recipe of the embedded model).

Owns: running the training script's smoke configuration on CPU on a small corpus
written by this test in the prepared format (no network: ``prepare`` is not run),
and checking that the output directory is a loadable Hugging Face model whose
recorded validation loss is reproduced by an independent re-evaluation, and that
two runs with the same seed give the same result.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_tiny_model_shipped import check_consistent_ids, load, reference_validation_loss

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "train_tiny.py"
DOC_SEPARATOR = "\n\f\n"  # the prepared format (scripts/train_tiny.py DOC_SEPARATOR)
LOSS_TOLERANCE = 1e-3

SPEECHES = [
    ("ROMEO", "But, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun."),
    ("ROMEO", "Arise, fair sun, and kill the envious moon,\nWho is already sick and pale with grief."),
    ("JULIET", "O Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name."),
    ("JULIET", "What's in a name? that which we call a rose\nBy any other name would smell as sweet."),
    ("NURSE", "Even or odd, of all days in the year,\nCome Lammas-eve at night shall she be fourteen."),
    ("MERCUTIO", "O, then, I see Queen Mab hath been with you.\nShe is the fairies' midwife, and she comes"),
    ("HAMLET", "To be, or not to be: that is the question:\nWhether 'tis nobler in the mind to suffer"),
    ("HAMLET", "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles,"),
    ("HORATIO", "Now cracks a noble heart. Good night, sweet prince;\nAnd flights of angels sing thee to thy rest!"),
    ("MACBETH", "Is this a dagger which I see before me,\nThe handle toward my hand? Come, let me clutch thee."),
    ("MACBETH", "Tomorrow, and tomorrow, and tomorrow,\nCreeps in this petty pace from day to day"),
    ("LADY MACBETH", "Out, damned spot! out, I say!\nHere's the smell of the blood still."),
    ("BANQUO", "Good sir, why do you start; and seem to fear\nThings that do sound so fair?"),
    ("PORTIA", "The quality of mercy is not strain'd,\nIt droppeth as the gentle rain from heaven"),
    ("ANTONY", "Friends, Romans, countrymen, lend me your ears;\nI come to bury Caesar, not to praise him."),
    ("PROSPERO", "We are such stuff\nAs dreams are made on, and our little life\nIs rounded with a sleep."),
]


def make_corpus(data: Path) -> None:
    """A few hundred lines in the prepared format: documents of shuffled speeches."""
    rng = random.Random(0)

    def document(n_speeches: int) -> str:
        return "\n\n".join(f"{who}:\n{text}" for who, text in (rng.choice(SPEECHES) for _ in range(n_speeches)))

    train = [document(40) for _ in range(3)]  # ~360 lines
    validation = [document(12) for _ in range(2)]  # ~70 lines
    data.mkdir(parents=True)
    (data / "train.txt").write_text(DOC_SEPARATOR.join(train) + "\n", encoding="utf-8")
    (data / "validation.txt").write_text(DOC_SEPARATOR.join(validation) + "\n", encoding="utf-8")


SMOKE_ARGS = [
    "--max-steps", "20", "--max-minutes", "0", "--device", "cpu", "--threads", "2", "--seed", "7",
    "--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate", "176",
    "--vocab-size", "384", "--seq-len", "64", "--batch-size", "8", "--warmup", "5",
    "--eval-every", "10", "--log-every", "10", "--eval-batch-size", "8",
]


def run_script(data: Path, out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--data", str(data), "--out", str(out), *SMOKE_ARGS],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "training.json").read_text())


@pytest.mark.slow
def test_smoke_training_end_to_end(tmp_path):
    import torch
    from safetensors.torch import load_file

    data = tmp_path / "data"
    make_corpus(data)
    out = tmp_path / "model"
    record = run_script(data, out)

    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "training.json", "validation.txt", "words.txt"):
        assert (out / name).is_file(), name
    assert record["steps"] == 20 and record["seed"] == 7
    assert record["device"].startswith("cpu")
    assert set(record["corpus_sha256"]) == {"train.txt", "validation.txt"}
    assert record["validation_windows"]["seq_len"] == 64
    assert record["validation_tokens"] == record["validation_windows"]["count"] * 64
    assert record["validation_curve"][-1]["val_loss"] < record["validation_curve"][0]["val_loss"]

    model, tokenizer = load(out)
    check_consistent_ids(model, tokenizer, out)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (64, 2, 1)
    assert cfg.tie_word_embeddings
    assert load_file(out / "model.safetensors")["model.embed_tokens.weight"].dtype == torch.bfloat16

    # The recorded loss is reproduced by an independent evaluation of the saved weights.
    loss = reference_validation_loss(model, tokenizer, record, out)
    assert loss == pytest.approx(record["validation_loss"], abs=LOSS_TOLERANCE)

    # The chat template is written as shipped, inside tokenizer_config.json.
    written = json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    shipped = json.loads((REPO / "hybridd/assets/tiny-shakespeare/tokenizer_config.json").read_text())
    assert written == shipped["chat_template"]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hark!"}], add_generation_prompt=True,
                                         tokenize=False) == "<s>ROMEO:\nHark!\n\nJULIET:\n"

    enc = tokenizer("ROMEO:", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == enc.input_ids.shape[1] + 8 or generated[0, -1] == tokenizer.eos_token_id
    assert isinstance(tokenizer.decode(generated[0], skip_special_tokens=True), str)

    # Same seed, same data, CPU: the run is reproducible.
    again = run_script(data, tmp_path / "model-again")
    assert again["validation_loss"] == record["validation_loss"]
    assert again["validation_curve"] == record["validation_curve"]
