"""Write a Hugging Face checkpoint with random weights of a real model's shape.

No checkpoint can be downloaded on the benchmark machines, so benchmarks and GPU
tests use random weights of the Llama-2-7B shape, the Llama-3-8B shape, or a smaller
preset, with a fixed seed, saved by transformers itself so that both transformers and
hybridd load it. The tokenizer is a synthetic word-level one over the preset's
vocabulary size (32000 or 128256 ids): benchmarks send token ids, and no real tokenizer
is needed to serve them.

    python -m hybridd.bench.random_checkpoint --preset llama2-7b --out /tmp/llama2-7b-random
    python -m hybridd.bench.random_checkpoint --preset llama3-8b --out /tmp/llama3-8b-random
    python -m hybridd.bench.random_checkpoint --describe /tmp/llama3-8b-random   # "Llama-3-8B shape, random weights"
    python -m hybridd.bench.random_checkpoint --preset llama3-8b --out /tmp/llama3-8b-random \
        --eagle3-head /tmp/llama3-8b-random-eagle3   # and a random EAGLE-3 head for it
    python -m hybridd.bench.random_checkpoint --preset llama3-8b --out /tmp/llama3-8b-predictable --predictable

An EAGLE-3 head (`make_eagle3_head`) is written in the published format (`hybridd.eagle3_head`)
for a checkpoint's shape: a speculative decoding bench times its draft steps at the real sizes.
`--predictable` writes weights whose greedy continuation of token t is perm(t)
(`make_predictable_weights`): speculative decoding benches set their acceptance with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

PRESETS = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    # Llama-3-8B: grouped-query attention (8 KV heads), a 128256-token vocabulary, RoPE theta 500000.
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    # Small enough for a CPU smoke run in seconds.
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024),
}
# How a preset is named in tables and plots: its shape, never the directory it was written to.
SHAPE_NAMES = {"llama2-7b": "Llama-2-7B", "llama3-8b": "Llama-3-8B", "llama-1b": "Llama-1B", "small": "small",
               "tiny": "tiny"}
MARKER = "hybridd-random.json"  # written beside the weights: the preset, seed and init they came from
# The published Llama-3 EAGLE-3 heads draft from the 32000 most frequent of the target's 128256 ids.
EAGLE3_DRAFT_VOCAB = 32000
HEAD_MARKER = "hybridd-random-eagle3.json"  # beside a head's weights: the target, seed and draft vocabulary
PREDICTABLE_SEED = 7  # the seed of a predictable checkpoint's permutation (`predictable_perm`)


def predictable_perm(vocab: int, seed: int = PREDICTABLE_SEED):
    """The token a predictable target follows each token with: token t by perm[t]."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


def make_predictable_weights(embed, head, norm, out_projections, seed: int = PREDICTABLE_SEED) -> None:
    """Bench only: give a random-weight target a greedy continuation that no rounding
    changes, so that a recorded continuation stays the target's own under any step shape
    (random weights give near-flat logits whose argmax flips between a one-row step's
    kernels and a verify step's, and a replayed continuation then stops matching). The
    attention and MLP outputs (`out_projections`: each layer's o_proj and down_proj
    weights) are scaled down, so the residual stream stays the token's embedding, and
    the LM-head row perm[t] becomes the embedding of t times the final norm's weight, so
    token t is followed by perm[t] (`predictable_perm`) by a margin of about sqrt(hidden)
    standard deviations. The shapes, and so every kernel's time, are unchanged."""
    if head.data_ptr() == embed.data_ptr():
        raise ValueError("make_predictable_weights needs an untied LM head")
    with torch.no_grad():
        for weight in out_projections:
            weight.mul_(1e-3)
        perm = predictable_perm(embed.shape[0], seed).to(embed.device)
        head[perm] = (embed.float() * norm.float()).to(head.dtype)


def make_checkpoint(
    out: Path, preset: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
    init: str = "normal", predictable: bool = False,
) -> Path:
    """`init`: "normal" draws every matrix from N(0, 0.02); "scaled" also divides the output
    projections (o_proj, down_proj) by sqrt(2 * layers), the GPT-2/Megatron residual
    scaling, so that the random network is not chaotic and bf16 noise is not amplified.
    `predictable`: then `make_predictable_weights` (greedy decoding follows t with perm[t])."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    marker = {"preset": preset, "seed": seed, "init": init}
    if predictable:
        marker["predictable_seed"] = PREDICTABLE_SEED
    if (out / "config.json").is_file() and (out / MARKER).is_file():
        if json.loads((out / MARKER).read_text()) == marker:
            return out
    config = LlamaConfig(**PRESETS[preset], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = config.initializer_range
            if init == "scaled" and name.endswith(("o_proj.weight", "down_proj.weight")):
                std /= (2 * config.num_hidden_layers) ** 0.5
            param.normal_(0.0, std, generator=generator)
        if predictable:
            inner = model.model
            make_predictable_weights(inner.embed_tokens.weight, model.lm_head.weight, inner.norm.weight,
                                     [w for layer in inner.layers
                                      for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)])
    model.save_pretrained(out, max_shard_size="4GB")
    save_synthetic_tokenizer(out, config.vocab_size)
    (out / MARKER).write_text(json.dumps(marker))
    del model
    return out


def make_eagle3_head(out: Path, target_dir: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                     device: str = "cpu", draft_vocab: int | None = None) -> Path:
    """A random EAGLE-3 head for the checkpoint in `target_dir`, in the published format
    (config.json, model.safetensors with d2t and t2d), of the shape the published
    Llama-3.1-8B head has for its target: hidden size, attention heads, KV heads and MLP
    width the target's, no embedding of its own (it embeds with the target's), and a draft
    vocabulary of `draft_vocab` ids (default: EAGLE3_DRAFT_VOCAB, at most a quarter of the
    target's) that map to a random sorted subset of the target's ids; it reads the target
    layers heads read by default (layers 0, L // 2, L - 1 of a target of fewer than 3
    layers, named in its eagle_config). Matrices are drawn
    from N(0, 0.02), norms are ones; written once per target, seed and draft vocabulary."""
    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    vocab, hidden = target["vocab_size"], target["hidden_size"]
    draft = draft_vocab or min(EAGLE3_DRAFT_VOCAB, vocab // 4)
    heads = target["num_attention_heads"]
    kv_heads = target.get("num_key_value_heads", heads)
    head_dim = target.get("head_dim") or hidden // heads
    inter = target["intermediate_size"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": target.get("rms_norm_eps", 1e-5), "vocab_size": vocab, "draft_vocab_size": draft,
        "target_hidden_size": hidden, "max_position_embeddings": target.get("max_position_embeddings", 2048),
        "rope_theta": (target.get("rope_parameters") or {}).get("rope_theta", target.get("rope_theta", 10000.0)),
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    for rope in ("rope_parameters", "rope_scaling"):  # transformers >= 5 writes the first, theta inside
        if target.get(rope):
            config[rope] = target[rope]
    layers = target["num_hidden_layers"]
    if layers < 3:  # the default layers (2, L // 2, L - 3) need three: name ones it has
        config["eagle_config"] = {"use_aux_hidden_state": True,
                                  "eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1]}
    marker = {"target": str(Path(target_dir).resolve()), "target_marker": _read_marker(Path(target_dir)),
              "seed": seed, "config": config}
    out.mkdir(parents=True, exist_ok=True)
    if (out / "model.safetensors").is_file() and (out / HEAD_MARKER).is_file():
        if json.loads((out / HEAD_MARKER).read_text()) == marker:
            return out
    shapes = {
        "fc.weight": (hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (inter, hidden),
        "midlayer.mlp.up_proj.weight": (inter, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, inter),
        "lm_head.weight": (draft, hidden),
    }
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {name: torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=generator)
             .to(dtype).cpu() for name, shape in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        state[f"{norm}.weight"] = torch.ones(hidden, dtype=dtype)
    # Draft id d is the target's d + d2t[d]: a sorted subset of the target's ids, as trained heads keep.
    chosen = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft].sort().values
    state["d2t"] = chosen - torch.arange(draft)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    state["t2d"] = t2d
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / HEAD_MARKER).write_text(json.dumps(marker))
    return out


def _read_marker(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def describe(model_dir: Path) -> str:
    """A checkpoint as a reader should see it named: "Llama-3-8B shape, random weights"
    for one this script wrote, else its directory's name."""
    try:
        marker = json.loads((Path(model_dir) / MARKER).read_text())
        preset = marker["preset"]
    except (OSError, ValueError, KeyError, TypeError):
        return Path(model_dir).name
    return f"{SHAPE_NAMES.get(preset, preset)} shape, random weights" + (
        " made predictable" if "predictable_seed" in marker else "")


def save_synthetic_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` made-up words ("w5 w17 ..."), so that the
    daemon can tokenize and detokenize for a random checkpoint; benchmarks send token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama2-7b")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--describe", type=Path, metavar="DIR", help="print how DIR is named in tables, and exit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--init", choices=("normal", "scaled"), default="normal")
    parser.add_argument("--predictable", action="store_true",
                        help="greedy decoding follows each token t with a fixed perm(t) (speculative decoding benches)")
    parser.add_argument("--eagle3-head", type=Path, metavar="DIR",
                        help="also write a random EAGLE-3 head for the checkpoint to DIR")
    args = parser.parse_args()
    if args.describe is not None:
        print(describe(args.describe))
        return 0
    if args.out is None:
        parser.error("--out is required (or --describe DIR)")
    path = make_checkpoint(args.out, args.preset, args.seed, device=args.device, init=args.init,
                           predictable=args.predictable)
    print(path)
    if args.eagle3_head is not None:
        print(make_eagle3_head(args.eagle3_head, path, args.seed, device=args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
