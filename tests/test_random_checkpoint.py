"""scripts/make_random_checkpoint.py names the checkpoints it writes by their shape, so
that a benchmark's table says which model it timed, not the directory it was written to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import make_random_checkpoint as mrc  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024)


@pytest.fixture
def llama3_named_tiny(monkeypatch):
    """A tiny model registered as the Llama-3-8B preset, so that one is written in seconds."""
    monkeypatch.setitem(mrc.PRESETS, "llama3-8b", TINY)
    return "llama3-8b"


def test_a_written_checkpoint_is_named_by_its_shape(tmp_path, llama3_named_tiny):
    out = mrc.make_checkpoint(tmp_path / "some-dir", llama3_named_tiny, device="cpu")
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 64
    assert mrc.describe(out) == "Llama-3-8B shape, random weights"


def test_another_directory_is_named_by_its_name(tmp_path):
    model = tmp_path / "my-llama"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert mrc.describe(model) == "my-llama"
    (model / mrc.MARKER).write_text("not json")
    assert mrc.describe(model) == "my-llama"
    (model / mrc.MARKER).write_text(json.dumps(["a list"]))
    assert mrc.describe(model) == "my-llama"
