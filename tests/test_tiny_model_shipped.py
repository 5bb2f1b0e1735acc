"""Checks of the shipped default model ``hybridd/assets/tiny-shakespeare``.

Owns: the acceptance checks of the embedded model (loads with transformers, its
recorded validation loss is reproduced, greedy text is mostly real words) and the
reference validation-loss evaluation that ``test_tiny_model_training`` reuses.
Skipped until ``scripts/train_tiny.py`` has produced ``model.safetensors``.
No network: the validation split and word list are stored in the asset directory.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

# HYBRIDD_TINY_MODEL_DIR points the checks at a candidate directory (e.g. a fresh GPU run in out/)
# before it is copied into hybridd/assets/.
ASSET_DIR = Path(os.environ.get("HYBRIDD_TINY_MODEL_DIR")
                 or Path(__file__).resolve().parent.parent / "hybridd" / "assets" / "tiny-shakespeare")
SHIPPED = (ASSET_DIR / "model.safetensors").is_file()

# The shipped model is trained on the GPU and evaluated there in float32 (TF32 off);
# re-evaluating on CPU in float32 differs only by accumulation order.
SHIPPED_LOSS_TOLERANCE = 2e-3
MAX_DIR_BYTES = 20 * 1024 * 1024
PROMPT = "ROMEO:"
NEW_TOKENS = 60
MIN_WORD_FRACTION = 0.70
WORD_RE = re.compile(r"[a-z]+")


def validation_token_ids(tokenizer, record: dict, model_dir: Path) -> list[int]:
    """The validation token stream exactly as training.json's ``validation_stream`` defines it."""
    stream = record["validation_stream"]
    text = (model_dir / stream["file"]).read_text(encoding="utf-8")
    if text.endswith("\n"):
        text = text[:-1]
    docs = [d for d in text.split(stream["document_separator"]) if d]
    ids: list[int] = []
    for doc_ids in tokenizer(docs, add_special_tokens=False).input_ids:
        ids += [tokenizer.bos_token_id, *doc_ids, tokenizer.eos_token_id]
    assert len(ids) == stream["n_tokens"], "validation stream differs from the one used in training"
    return ids


def reference_validation_loss(model, tokenizer, record: dict, model_dir: Path, batch_size: int = 16) -> float:
    """Mean token cross-entropy over the windows recorded in training.json (float32, CPU)."""
    import torch
    import torch.nn.functional as F

    ids = torch.tensor(validation_token_ids(tokenizer, record, model_dir))
    w = record["validation_windows"]
    seq_len, stride, count, first = w["seq_len"], w["stride"], w["count"], w["first_start"]
    assert first + (count - 1) * stride + seq_len + 1 <= len(ids)
    total, n = 0.0, 0
    model.eval()
    with torch.no_grad():
        for b in range(0, count, batch_size):
            rows = [ids[first + i * stride : first + i * stride + seq_len + 1] for i in range(b, min(b + batch_size, count))]
            chunk = torch.stack(rows)
            logits = model(input_ids=chunk[:, :-1], use_cache=False).logits.float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum").item()
            n += chunk[:, 1:].numel()
    assert n == record["validation_tokens"]
    return total / n


def load(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # transformers 5 loads in the stored dtype (bfloat16) by default; evaluate in float32.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, tokenizer


def check_consistent_ids(model, tokenizer, model_dir: Path) -> None:
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(model_dir)
    cfg = model.config
    assert (cfg.bos_token_id, cfg.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert (gen.bos_token_id, gen.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    assert gen.pad_token_id == cfg.pad_token_id == tokenizer.pad_token_id
    assert len(tokenizer) == cfg.vocab_size
    assert tokenizer("x").input_ids[0] == tokenizer.bos_token_id  # prompts start with <s>, as in training


def dictionary_fraction(text: str, words: set[str]) -> tuple[float, list[str]]:
    """Fraction of the alphabetic words (length >= 2) of ``text`` that are in ``words``."""
    found = [w for w in WORD_RE.findall(text.lower()) if len(w) >= 2]
    if not found:
        return 0.0, found
    return sum(w in words for w in found) / len(found), found


pytestmark = pytest.mark.skipif(not SHIPPED, reason=f"{ASSET_DIR}/model.safetensors not built yet (scripts/train_tiny.py)")


@pytest.fixture(scope="module")
def shipped():
    model, tokenizer = load(ASSET_DIR)
    record = json.loads((ASSET_DIR / "training.json").read_text())
    return model, tokenizer, record


def test_shipped_directory_is_a_small_standard_hf_model(shipped):
    model, tokenizer, record = shipped
    size = sum(p.stat().st_size for p in ASSET_DIR.iterdir() if p.is_file())
    assert size <= MAX_DIR_BYTES, f"asset directory is {size / 1e6:.1f} MB"
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # exercises GQA
    check_consistent_ids(model, tokenizer, ASSET_DIR)
    for key in ("validation_loss", "validation_tokens", "validation_windows", "seed", "hyperparameters",
                "steps", "wall_time_s", "device", "versions", "corpus_sha256"):
        assert key in record, key


def test_shipped_chat_template_writes_speeches_as_the_corpus_does(shipped):
    _, tokenizer, _ = shipped
    chat = [{"role": "system", "content": "Enter ROMEO and JULIET."},
            {"role": "user", "content": " What light through yonder window breaks? "},
            {"role": "assistant", "content": "It is the east."},
            {"role": "user", "content": "Speak again.", "name": "Benvolio"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == ("<s>[Enter ROMEO and JULIET.]\n\nROMEO:\nWhat light through yonder window breaks?\n\n"
                        "JULIET:\nIt is the east.\n\nBENVOLIO:\nSpeak again.\n\nJULIET:\n")
    validation = (ASSET_DIR / "validation.txt").read_text(encoding="utf-8")
    # the corpus's own form: speakers in capitals on a line, stage directions in brackets
    assert len(re.findall(r"\n\n[A-Z][A-Z ]+:\n", validation)) > 100 and "\n\n[Exeunt.]" in validation


@pytest.mark.slow
def test_shipped_validation_loss_is_reproduced(shipped):
    model, tokenizer, record = shipped
    loss = reference_validation_loss(model, tokenizer, record, ASSET_DIR)
    assert loss == pytest.approx(record["validation_loss"], abs=SHIPPED_LOSS_TOLERANCE)


def test_shipped_greedy_text_is_mostly_words(shipped):
    """Honest check: >= 70% of the alphabetic words (length >= 2) of a greedy 60-token
    continuation of "ROMEO:" occur >= 3 times in the training split (words.txt)."""
    import torch

    model, tokenizer, _ = shipped
    words = set((ASSET_DIR / "words.txt").read_text(encoding="utf-8").split())
    enc = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
    text = tokenizer.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)
    fraction, found = dictionary_fraction(text, words)
    assert len(found) >= 10, f"too few words in the continuation: {text!r}"
    assert fraction >= MIN_WORD_FRACTION, f"{fraction:.0%} dictionary words in {text!r}"


def test_shipped_hybridd_runtime_matches_transformers(shipped):
    """hybridd's own runtime and transformers agree on the shipped model: greedy
    continuations of a few prompts are token-identical (float32, CPU)."""
    import torch

    from hybridd.model import load_model
    from hybridd.engine.generate import greedy_generate

    model, tokenizer, _ = shipped
    ours = load_model(ASSET_DIR, dtype=torch.float32)
    for prompt in ("ROMEO:", "JULIET:\nO Romeo, Romeo", "HAMLET:\nTo be, or not to be"):
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=None)
        assert greedy_generate(ours, [ids], 40)[0] == ref[0, len(ids):].tolist(), prompt
