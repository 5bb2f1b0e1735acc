"""scripts/make_random_checkpoint.py names the checkpoints it writes by their shape, so
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
    proc = subprocess.run([sys.executable, "-m", "scripts.make_random_checkpoint"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "--out is required (or --describe DIR)" in proc.stderr
