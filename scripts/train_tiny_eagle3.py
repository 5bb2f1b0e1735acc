"""Train the EAGLE-3 head shipped for the embedded model, ``hybridd/assets/tiny-shakespeare-eagle3``.

Self-distillation, as EAGLE-3 trains: the embedded model continues prompts taken from the
second half of its ``validation.txt`` greedily (the first half holds the prompts the
tests measure acceptance on), and the head learns, for every position i of those
sequences, the model's token i + 2 from the model's hidden states at i (the inputs of
its layers 2, 4 and 5) and token i + 1. Its vocabulary is the 1024 tokens most frequent
in those sequences (d2t maps them to the model's). Its first three draft steps are
trained together (EAGLE-3's training-time test: a step reads the head's own output of
the step before, and attends to the model's pairs and its own chain).

The head is written in the published format (config.json of LlamaForCausalLMEagle3,
model.safetensors in bfloat16 with d2t and t2d) with its own embedding (hidden size 32:
about 190K parameters, a few hundred KB), plus ``training.json``. The shipped head is::

    nice python -m scripts.train_tiny_eagle3 --threads 1

(a few minutes on one CPU thread).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from hybridd.config import EMBEDDED_MODEL
from hybridd.eagle3_head import ARCHITECTURE, default_aux_layers
from hybridd.engine.generate import generate
from hybridd.model import KVCache, StepInputs, load_model
from hybridd.model.tokenizer import load_tokenizer
from hybridd.protocol.messages import SamplingParams

OUT = EMBEDDED_MODEL.parent / "tiny-shakespeare-eagle3"


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [heads, T, d] at positions 0..T-1."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.outer(torch.arange(x.shape[1]).float(), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


class TrainingHead(nn.Module):
    """The head's first draft step over a whole sequence, with the published tensor names."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        h, n, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = h // n
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], h)
        self.fc = nn.Linear(3 * cfg["target_hidden_size"], h, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.input_layernorm, m.hidden_norm, m.post_attention_layernorm = _Norm(h), _Norm(h), _Norm(h)
        m.self_attn = nn.Module()
        m.self_attn.q_proj = nn.Linear(2 * h, n * self.head_dim, bias=False)
        m.self_attn.k_proj = nn.Linear(2 * h, kv * self.head_dim, bias=False)
        m.self_attn.v_proj = nn.Linear(2 * h, kv * self.head_dim, bias=False)
        m.self_attn.o_proj = nn.Linear(n * self.head_dim, h, bias=False)
        m.mlp = nn.Module()
        m.mlp.gate_proj = nn.Linear(h, cfg["intermediate_size"], bias=False)
        m.mlp.up_proj = nn.Linear(h, cfg["intermediate_size"], bias=False)
        m.mlp.down_proj = nn.Linear(cfg["intermediate_size"], h, bias=False)
        self.norm = _Norm(h)
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor, steps: int = 1) -> list[torch.Tensor]:
        """Draft logits [T, draft vocab] of each of `steps` draft steps for pairs (aux[j],
        next_ids[j]) (training-time test, as EAGLE-3 trains): step s at row j is the draft
        step s + 1 of a draft begun after pair j - s, whose input is the head's output of step
        s - 1 at row j - 1; it attends to the model's pairs up to j - s and to its own
        chain's keys at j - s + 1 .. j. Rows j < s of step s have no draft behind them."""
        m, t = self.midlayer, next_ids.shape[0]
        a = m.self_attn
        theta = self.cfg["rope_theta"]
        embeds = m.input_layernorm(self.embed_tokens(next_ids))
        hidden = self.fc(aux)
        keys, values, logits = [], [], []
        rows = torch.arange(t)
        for step in range(steps):
            x = torch.cat([embeds, m.hidden_norm(hidden)], -1)
            q = _rope(a.q_proj(x).view(t, -1, self.head_dim).transpose(0, 1), theta)
            k = _rope(a.k_proj(x).view(t, -1, self.head_dim).transpose(0, 1), theta)
            v = a.v_proj(x).view(t, -1, self.head_dim).transpose(0, 1)
            groups = q.shape[0] // k.shape[0]
            keys.append(k.repeat_interleave(groups, 0))
            values.append(v.repeat_interleave(groups, 0))
            scale = self.head_dim ** -0.5
            # The model's pairs: columns up to j - step.
            scores = [(q @ keys[0].transpose(1, 2) * scale).masked_fill(rows[None, :] > rows[:, None] - step,
                                                                        float("-inf"))]
            chain = []
            for back in range(1, step + 1):  # this chain's keys at row j - step + back
                src = (rows - step + back).clamp(min=0)
                scores.append(((q * keys[back][:, src]).sum(-1) * scale)[..., None])
                chain.append(values[back][:, src])
            weights = torch.softmax(torch.cat(scores, -1), -1).nan_to_num(0.0)
            o = weights[..., :t] @ values[0]
            for back, v_back in enumerate(chain, start=1):
                o = o + weights[..., t + back - 1:t + back] * v_back
            o = o.transpose(0, 1).reshape(t, -1)
            residual = hidden + a.o_proj(o)
            y = m.post_attention_layernorm(residual)
            out = residual + m.mlp.down_proj(F.silu(m.mlp.gate_proj(y)) * m.mlp.up_proj(y))
            logits.append(self.lm_head(self.norm(out)))
            hidden = torch.cat([out[:1], out[:-1]])  # row j reads row j - 1's output
        return logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--draft-vocab", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps trained (training-time test)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.monotonic()
    model = load_model(EMBEDDED_MODEL, dtype=torch.float32, kernels="torch")
    mc = model.config
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    text = (EMBEDDED_MODEL / "validation.txt").read_text()
    half = len(text) // 2
    step = (len(text) - half - 400) // args.prompts
    prompts = [tokenizer.encode(text[half + i * step: half + i * step + 200]) for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    sequences = [p + list(seqs[0].output_token_ids) for p, seqs in zip(prompts, generate(model, prompts, params))]
    print(f"generated {len(sequences)} sequences in {time.monotonic() - started:.0f}s", flush=True)
    layers = default_aux_layers(mc.num_layers)
    data = []
    with torch.no_grad():
        for seq in sequences:
            n = len(seq) - 2
            kv = KVCache.allocate(mc, -(-n // 16), 16, torch.float32, "cpu")
            inputs = StepInputs.prefill([seq[:n]], [list(range(kv.num_blocks))], 16)
            _, aux = model.forward_aux(inputs, kv, layers)
            data.append((aux.clone(), torch.tensor(seq[1:n + 1]), torch.tensor(seq[2:n + 2])))
    counts = torch.bincount(torch.tensor(sum(sequences, [])), minlength=mc.vocab_size)
    vocab = torch.sort(torch.argsort(counts, descending=True)[: args.draft_vocab]).values
    t2d = torch.full((mc.vocab_size,), -100, dtype=torch.int64)
    t2d[vocab] = torch.arange(args.draft_vocab)
    cfg = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden, "num_attention_heads": 2,
        "num_key_value_heads": 1, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": mc.max_position_embeddings, "tie_word_embeddings": False,
        "vocab_size": mc.vocab_size, "draft_vocab_size": args.draft_vocab, "target_hidden_size": mc.hidden_size,
        "torch_dtype": "bfloat16",
    }
    head = TrainingHead(cfg)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(data)
    curve = []
    for i in range(total):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (i + 1) / 50) * (0.1 + 0.9 * (1 - i / total))
        aux, ids, labels = data[torch.randint(len(data), ()).item()]
        loss = sum(0.8 ** step * F.cross_entropy(logits[step:], t2d[labels][step:], ignore_index=-100)
                   for step, logits in enumerate(head(aux, ids, args.ttt_steps)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (i + 1) % 100 == 0:
            curve.append({"step": i + 1, "loss": round(float(loss.detach()), 4)})
            print(f"step {i + 1}/{total} loss {float(loss.detach()):.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in head.state_dict().items()}
    state["d2t"] = vocab - torch.arange(args.draft_vocab)
    mask = torch.zeros(mc.vocab_size, dtype=torch.bool)
    mask[vocab] = True
    state["t2d"] = mask
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps({
        "command": "python -m scripts.train_tiny_eagle3 " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "target": EMBEDDED_MODEL.name, "aux_layers": list(layers), "sequences": len(sequences),
        "pairs": sum(len(d[1]) for d in data), "steps": total, "loss_curve": curve,
        "seconds": round(time.monotonic() - started),
    }, indent=2) + "\n")
    print(f"wrote {out} in {time.monotonic() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
