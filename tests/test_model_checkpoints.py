"""Checkpoint settings beyond the tiny models' defaults behave as transformers does:
stop tokens from generation_config.json (the workers honouring them are tested in
test_runtime_decoupled), Mistral's sliding window, Llama's attention bias, linear RoPE
scaling; and what the model cannot do is refused, naming the limit."""

from __future__ import annotations

import json

import pytest
import torch

from hybridd.model import KVCache, ModelLoadError, StepInputs, load_model
from hybridd.model.config import ModelConfig
from hybridd.model.errors import SequenceTooLongError
from hybridd.engine.generate import greedy_generate
from tests.test_model_correctness import REL_TOL, prompts, reference_greedy, rel_err
from tests.tiny_models import build_tiny_model


def _edit_json(path, **changes) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


# ---------------------------------------------------------------- stop tokens


def test_eos_ids_come_from_generation_config_as_int_or_list(tmp_path):
    build_tiny_model("llama", tmp_path)
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2,)
    _edit_json(tmp_path / "generation_config.json", eos_token_id=[7, 11, 2])
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (7, 11, 2)
    _edit_json(tmp_path / "generation_config.json", eos_token_id=9)
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (9,)


@pytest.mark.parametrize(("content", "message"), [
    ("{broken", "generation_config.json: not valid JSON"),
    ('{"eos_token_id": "two"}', "generation_config.json: field 'eos_token_id' must be a token id or a list"),
    ('{"eos_token_id": [2, -1]}', "generation_config.json: field 'eos_token_id' must be a token id or a list"),
])
def test_bad_generation_config_names_the_file_and_field(tmp_path, content, message):
    build_tiny_model("llama", tmp_path)
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dir(tmp_path)


# ---------------------------------------------------------------- sliding window


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A Mistral whose sliding window (8) is far shorter than the sequences it is run on."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("mistral-window")
    build_tiny_model("mistral", path, sliding_window=8)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, reference


@torch.inference_mode()
def test_sliding_window_beyond_the_window_matches_transformers(windowed):
    path, reference = windowed
    ours = load_model(path, dtype=torch.float32, max_positions=64)
    prompt = prompts(1, seed=5, lo=30, hi=31)[0]
    expected = reference(torch.tensor([prompt])).logits[0]
    kv = KVCache.allocate(ours.config, 8, 8, torch.float32, "cpu")
    got = ours.compute_logits(ours(StepInputs.prefill([prompt], [[5, 1, 6, 0]], 8), kv))
    assert rel_err(got, expected) <= REL_TOL

    tokens, ref_logits = reference_greedy(reference, prompt, 16)
    table = [5, 1, 6, 0, 2, 7]
    kv = KVCache.allocate(ours.config, 8, 8, torch.float32, "cpu")
    got = ours.forward_logits(StepInputs.prefill([prompt], [table], 8), kv)[0]
    for i in range(1, 16):
        step = StepInputs.decode([tokens[i - 1]], [len(prompt) + i - 1], [table], 8)
        got = ours.forward_logits(step, kv)[0]
        assert rel_err(got, ref_logits[i]) <= REL_TOL, f"decode step {i}"
    assert greedy_generate(ours, [prompt], 16, block_size=8)[0] == tokens


def test_sliding_window_is_refused_by_kernels_without_it(windowed):
    from hybridd.kernels.selection import TritonKernels

    path, _ = windowed
    ours = load_model(path, dtype=torch.float32, max_positions=64)
    ours.kernels = TritonKernels()
    with pytest.raises(ModelLoadError, match="sliding_window"):
        greedy_generate(ours, [[5, 6, 7]], 2)


# ---------------------------------------------------------------- sequence length


def test_sequence_longer_than_max_positions_is_refused_naming_the_limit(tmp_path):
    build_tiny_model("llama", tmp_path)
    model = load_model(tmp_path, dtype=torch.float32, max_positions=32)
    with pytest.raises(SequenceTooLongError, match="max_positions 32"):
        greedy_generate(model, [list(range(3, 30))], 8)  # 27 + 8 tokens
    kv = KVCache.allocate(model.config, 4, 16, torch.float32, "cpu")
    with pytest.raises(SequenceTooLongError, match="position 40, past max_positions 32"):
        model(StepInputs.prefill([list(range(3, 44))], [[0, 1, 2]], 16), kv)
    assert len(greedy_generate(model, [list(range(3, 27))], 8)[0]) == 8  # 32 tokens: within the limit


# ---------------------------------------------------------------- attention bias and RoPE scaling


@torch.inference_mode()
@pytest.mark.parametrize(("arch", "overrides"), [
    ("llama", {"attention_bias": True}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
])
def test_checkpoint_settings_match_transformers(tmp_path, arch, overrides):
    from transformers import AutoModelForCausalLM

    build_tiny_model(arch, tmp_path, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(tmp_path, dtype=torch.float32)
    prompt = prompts(1, seed=9, lo=40, hi=41)[0]
    kv = KVCache.allocate(ours.config, 4, 16, torch.float32, "cpu")
    got = ours.compute_logits(ours(StepInputs.prefill([prompt], [[2, 0, 1]], 16), kv))
    assert rel_err(got, reference(torch.tensor([prompt])).logits[0]) <= REL_TOL
    expected, _ = reference_greedy(reference, prompt, 12)
    assert greedy_generate(ours, [prompt], 12)[0] == expected


def test_linear_rope_scaling_without_factor_names_the_field(tmp_path):
    build_tiny_model("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        cfg.pop(key, None)
    for scaling in ({"rope_type": "linear"}, {"rope_type": "linear", "factor": 0}, {"type": "linear", "factor": "x"}):
        cfg["rope_scaling"] = scaling
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=r"field 'rope_scaling\.factor'"):
            load_model(tmp_path)
