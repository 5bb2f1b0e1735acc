"""Qwen3 dense and YaRN RoPE beyond the shared suite (tests/test_model_correctness.py runs
both, as `qwen3` and `qwen2_yarn`, like every supported config): YaRN's frequencies and
attention factor as transformers computes them for every way a config can state them,
the fields that cannot be served refused by name, and a tiny Qwen3 with YaRN served by the
two worker processes, token for token as transformers decodes it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridd.config import EMBEDDED_MODEL
from hybridd.model import KVCache, ModelLoadError, StepInputs, load_model, load_tokenizer
from hybridd.model.config import ModelConfig
from hybridd.model.rope import cos_sin_table, inverse_frequencies
from tests.engine_pair import EnginePair
from tests.test_model_correctness import REL_TOL, prompts, reference_greedy, rel_err
from tests.tiny_models import YARN, build_tiny_model


def _transformers_yarn(scaling: dict, max_positions: int = 512, **top_level) -> tuple[torch.Tensor, float]:
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen2Config(hidden_size=64, num_attention_heads=2, max_position_embeddings=max_positions,
                         rope_scaling=dict(scaling), rope_theta=1000000.0, **top_level)
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


def _ours(scaling: dict, max_positions: int = 512, **top_level) -> ModelConfig:
    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": max_positions,
           "rope_theta": 1000000.0, "rope_scaling": dict(scaling), **top_level}
    return ModelConfig.from_dict(cfg)


@pytest.mark.parametrize(("scaling", "top_level"), [
    (YARN, {}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, {}),
    ({"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2}, {}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "truncate": False}, {}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 0.8}, {}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.707,
      "mscale_all_dim": 0.5}, {}),
    ({"rope_type": "yarn", "factor": 4.0}, {"original_max_position_embeddings": 64}),  # Phi-3's top-level field
])
def test_yarn_frequencies_and_attention_factor_are_transformers(scaling, top_level):
    expected_inv_freq, expected_factor = _transformers_yarn(scaling, **top_level)
    config = _ours(scaling, **top_level)
    assert config.rope.rope_type == "yarn"
    assert config.rope.attention_factor == pytest.approx(expected_factor, rel=1e-12)
    torch.testing.assert_close(inverse_frequencies(config.rope, config.head_dim), expected_inv_freq,
                               rtol=1e-6, atol=0)
    cos, sin = cos_sin_table(config.rope, config.head_dim, 4)
    assert cos[0, 0].item() == pytest.approx(expected_factor)  # the attention factor scales cos and sin
    assert sin[0].abs().max().item() == 0.0


@pytest.mark.parametrize(("changes", "field"), [
    ({"rope_scaling": {"rope_type": "yarn", "factor": -2.0, "original_max_position_embeddings": 32}},
     r"rope_scaling\.factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                       "beta_fast": 1, "beta_slow": 8}}, r"rope_scaling\.beta_fast"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}}, r"rope_scaling\.truncate"),
    ({"original_max_position_embeddings": 0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "'original_max_position_embeddings'"),
    ({"partial_rotary_factor": 0.5}, "'partial_rotary_factor'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, r"rope_scaling\.rope_type.*'longrope'"),
    ({"use_sliding_window": True, "sliding_window": 64}, "'use_sliding_window'"),
])
def test_what_cannot_be_served_is_refused_naming_the_field(changes, field):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 32, "max_position_embeddings": 512}
    ModelConfig.from_dict(cfg)
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict(cfg | changes)


@torch.inference_mode()
def test_qwen3_head_norms_and_yarn_each_change_the_logits(tmp_path):
    """The suite's comparisons have teeth: without its q/k norms or its YaRN scaling, the
    same Qwen3 weights give other logits than transformers' model."""
    from transformers import AutoModelForCausalLM

    build_tiny_model("qwen3", tmp_path, rope_scaling=dict(YARN))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = prompts(1, seed=4, lo=60, hi=61)[0]
    expected = reference(torch.tensor([prompt])).logits[0]

    def logits(model) -> torch.Tensor:
        kv = KVCache.allocate(model.config, 4, 16, torch.float32, "cpu")
        return model.compute_logits(model(StepInputs.prefill([prompt], [[1, 3, 0, 2]], 16), kv))

    ours = load_model(tmp_path, dtype=torch.float32)
    assert ours.config.qk_norm and ours.config.rope.rope_type == "yarn" and ours.config.head_dim == 32
    assert rel_err(logits(ours), expected) <= REL_TOL
    for layer in ours.layers:
        del layer.q_norm, layer.k_norm
    assert rel_err(logits(ours), expected) > 100 * REL_TOL

    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert rel_err(logits(load_model(tmp_path, dtype=torch.float32)), expected) > 100 * REL_TOL


@pytest.mark.slow
def test_daemon_serves_a_qwen3_with_yarn_as_transformers_decodes(tmp_path):
    """Two worker processes over real sockets and shared memory serve a tiny Qwen3 with
    YaRN (the embedded model's tokenizer beside random weights): each greedy continuation,
    alone and four at once, is the one transformers decodes."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "qwen3-yarn"
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    build_tiny_model("qwen3", model_dir, rope_scaling=dict(YARN), vocab_size=len(tokenizer))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, model_dir / name)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = ["ROMEO:", "JULIET:\nO Romeo, Romeo", "HAMLET:\nTo be, or not to be, that is", "KING LEAR:\nBlow"]
    expected = {text: reference_greedy(reference, tokenizer.encode(text), 24)[0] for text in texts}

    (tmp_path / "run").mkdir()
    engine = EnginePair(tmp_path / "run", model=str(model_dir), device="cpu", dtype="float32")
    try:
        engine.wait_ready()
        client = engine.client()
        sampling = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        final, _ = client.generate(prompt=texts[0], sampling=sampling)
        assert final["type"] == "final", final
        assert final["token_ids"] == expected[texts[0]]
        rids = {client.send({"type": "generate", "prompt": text, "sampling": sampling}): text for text in texts}
        for rid, text in rids.items():
            assert client.collect(rid, timeout=120)[0]["token_ids"] == expected[text], text
        client.close()
    finally:
        engine.close()


@torch.inference_mode()
@pytest.mark.parametrize("fusions", ["none", "norm,rotary"])
def test_qwen3_through_the_triton_kernels_equals_the_torch_path(tmp_path, fusions):
    """Triton's kernels (in its interpreter here, as conftest sets it without CUDA) run the
    heads' norm between the qkv projection and RoPE, never in the projection's epilogue:
    prefill and decode logits are the torch path's."""
    from hybridd.kernels.choices import KernelChoices

    build_tiny_model("qwen3", tmp_path, rope_scaling=dict(YARN))
    reference = load_model(tmp_path, dtype=torch.float32, kernels="torch")
    ours = load_model(tmp_path, dtype=torch.float32, kernels=KernelChoices.from_settings("triton", fusions, False))
    prompt = prompts(1, seed=3, lo=20, hi=21)[0]
    caches = [KVCache.allocate(reference.config, 4, 16, torch.float32, "cpu") for _ in range(2)]
    for step in (StepInputs.prefill([prompt], [[2, 0]], 16), StepInputs.decode([5], [20], [[2, 0]], 16)):
        expected, got = (model.forward_logits(step, kv) for model, kv in zip((reference, ours), caches, strict=True))
        assert rel_err(got, expected) <= REL_TOL
