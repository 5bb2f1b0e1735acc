"""Tiny random Llama-family checkpoints made with transformers' own classes."""

from __future__ import annotations

from pathlib import Path

import torch

# llama3: Llama 3.1's RoPE scaling; llama3_2: Llama 3.2's (tied embeddings, factor 32);
# qwen3: Qwen3 dense (q/k norms, a head_dim of its own); qwen2_yarn: Qwen2.5's long-context YaRN.
ARCHITECTURES = ("llama", "llama3", "llama3_2", "mistral", "qwen2", "qwen2_yarn", "qwen3")

# A long-context YaRN scaling over a short pre-training length, so that the tiny models'
# positions reach past it.
YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32}


def tiny_config(arch: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "llama3":
        return LlamaConfig(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
            **common,
        )
    if arch == "llama3_2":
        return LlamaConfig(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
            tie_word_embeddings=True,
            **common,
        )
    if arch == "mistral":
        return MistralConfig(**({"sliding_window": None} | common))
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)
    if arch == "qwen2_yarn":
        return Qwen2Config(rope_scaling=dict(YARN), rope_theta=1000000.0, **common)
    if arch == "qwen3":
        return Qwen3Config(**({"head_dim": 32, "tie_word_embeddings": True} | common))
    raise ValueError(arch)


def build_tiny_model(arch: str, path: Path, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is small; widen the weights so logits are far from uniform and greedy
    # decoding is a meaningful comparison.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("bias"):
                p.normal_(0.0, 0.05)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.2)  # unit weights would leave the heads' norm weights untested
    model.save_pretrained(path)
    return model
