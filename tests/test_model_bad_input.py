"""Unusable model directories get an error that names the file or field at fault."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridd.model import ModelLoadError, load_model, load_tokenizer
from hybridd.model.config import ModelConfig
from tests.tiny_models import build_tiny_model


@pytest.fixture
def model_dir(tmp_path):
    build_tiny_model("llama", tmp_path / "m")
    return tmp_path / "m"


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json not found"):
        load_model(model_dir)


def test_corrupt_config(model_dir):
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        load_model(model_dir)


def test_missing_weight_file(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files"):
        load_model(model_dir)


def test_corrupt_weight_file(model_dir):
    data = (model_dir / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(ModelLoadError, match="model.safetensors: cannot read"):
        load_model(model_dir)


def test_wrong_tensor_shape(model_dir):
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 99)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.down_proj.weight' has shape \(64, 99\)"):
        load_model(model_dir)


def test_missing_tensor(model_dir):
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks tensor\(s\) model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(model_dir)


def test_unexpected_tensor(model_dir):
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        load_model(model_dir)


def test_sharded_checkpoint_with_index(model_dir):
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, model_dir / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in shard_names})
    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(model_dir)
    assert torch.equal(model.layers[1].down_proj.weight, tensors["model.layers.1.mlp.down_proj.weight"])

    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="shard 'model-00002-of-00002.safetensors'"):
        load_model(model_dir)


def test_dtype_override(model_dir):
    model = load_model(model_dir, dtype="bfloat16")
    assert model.layers[0].qkv_proj.weight.dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="unsupported dtype 'int3'"):
        load_model(model_dir, dtype="int3")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "field 'architectures': unsupported architecture 'GPT2LMHeadModel'"),
        ({"architectures": None}, "field 'architectures'"),
        ({"hidden_size": None}, "missing required field 'hidden_size'"),
        ({"num_hidden_layers": -1}, "field 'num_hidden_layers' must be a positive integer"),
        ({"num_key_value_heads": 3}, "field 'num_key_value_heads'"),
        ({"hidden_act": "gelu"}, "field 'hidden_act'"),
        ({"mlp_bias": True}, "field 'mlp_bias'"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "field 'rope_scaling.rope_type': unsupported 'longrope'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "field 'rope_scaling.low_freq_factor'"),
        ({"dtype": "int8"}, "field 'dtype'"),
    ],
)
def test_bad_config_fields(model_dir, changes, message):
    edit_config(model_dir, **changes)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_model(model_dir)


def test_qwen2_sliding_window_rejected():
    cfg = {
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
        "intermediate_size": 128, "vocab_size": 10, "max_position_embeddings": 64, "use_sliding_window": True,
    }
    with pytest.raises(ModelLoadError, match="field 'use_sliding_window'"):
        ModelConfig.from_dict(cfg)


def test_mistral_sliding_window_bounds_context():
    cfg = {
        "architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
        "intermediate_size": 128, "vocab_size": 10, "max_position_embeddings": 4096, "sliding_window": 1024,
    }
    assert ModelConfig.from_dict(cfg).max_model_len == 1024


def test_missing_tokenizer(model_dir):
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_tokenizer(model_dir)


def test_corrupt_tokenizer(model_dir, tmp_path):
    (model_dir / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_tokenizer(model_dir)
