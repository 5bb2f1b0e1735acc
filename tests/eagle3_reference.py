"""An EAGLE-3 head written from the published modeling code (SGLang's and vLLM's
`LlamaForCausalLMEagle3`, EAGLE's `cnets.py`) with transformers' own Llama parts: the
reference the tests check hybridd's head against, and the module they train tiny heads
with. Its parameters carry the published names; `save_head` writes the published format
(config.json, model.safetensors with d2t/t2d). Nothing here uses hybridd's code.

The published semantics it encodes: the target's hidden states are the inputs of its
layers 2, L // 2 and L - 3 (transformers' `output_hidden_states[j]`), side by side, mixed
by `fc`; the decoder layer attends over cat(rmsnorm(embedding of the next token),
rmsnorm(hidden)) (q/k/v of 2 x hidden), the residual is the un-normed hidden; the logits
read norm(residual stream), a further step reads the stream before that norm; draft id
d is the target's d + d2t[d].
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding


def head_config(target_config, hidden: int = 48, heads: int = 4, kv_heads: int = 2, intermediate: int = 96,
                draft_vocab: int | None = None, **extra) -> dict:
    """A head's config.json for the transformers model config `target_config`."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
        "vocab_size": target_config.vocab_size, "draft_vocab_size": draft_vocab or target_config.vocab_size,
        "target_hidden_size": target_config.hidden_size, "max_position_embeddings": 512,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32", **extra,
    }


def aux_layers(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


class ReferenceEagle3(nn.Module):
    def __init__(self, config: dict, d2t: torch.Tensor | None = None, embeddings: torch.Tensor | None = None) -> None:
        """`embeddings`: the target's (frozen, not saved) where the head has none of its own."""
        super().__init__()
        llama = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "draft_vocab_size",
                                                                           "target_hidden_size",
                                                                           "norm_before_residual")})
        llama._attn_implementation = "eager"
        self.config = config
        h, head_dim = config["hidden_size"], config["hidden_size"] // config["num_attention_heads"]
        self.fc = nn.Linear(3 * config["target_hidden_size"], h, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.input_layernorm = LlamaRMSNorm(h, eps=config["rms_norm_eps"])
        self.midlayer.hidden_norm = LlamaRMSNorm(h, eps=config["rms_norm_eps"])
        self.midlayer.post_attention_layernorm = LlamaRMSNorm(h, eps=config["rms_norm_eps"])
        attn = LlamaAttention(llama, layer_idx=0)
        attn.q_proj = nn.Linear(2 * h, config["num_attention_heads"] * head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * h, config["num_key_value_heads"] * head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * h, config["num_key_value_heads"] * head_dim, bias=False)
        self.midlayer.self_attn = attn
        self.midlayer.mlp = LlamaMLP(llama)
        self.norm = LlamaRMSNorm(h, eps=config["rms_norm_eps"])
        self.lm_head = nn.Linear(h, config["draft_vocab_size"], bias=False)
        self.rotary = LlamaRotaryEmbedding(llama)
        self.own_embeddings = embeddings is None
        self.embed_tokens = nn.Embedding(config["vocab_size"], h)
        if embeddings is not None:
            self.embed_tokens.weight.data.copy_(embeddings)
            self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("d2t", d2t if d2t is not None else torch.zeros(config["draft_vocab_size"],
                                                                            dtype=torch.int64))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] next tokens, [B, T, hidden] combined states: (normed output, output before the norm)."""
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        # vLLM's norm_before_residual (heads trained so): the residual is the normed hidden.
        residual = normed if self.config.get("norm_before_residual") else hidden
        x = torch.cat([layer.input_layernorm(self.embed_tokens(input_ids)), normed], dim=-1)
        t = input_ids.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        attn, _ = layer.self_attn(x, self.rotary(x, position_ids), mask)
        residual = residual + attn
        prenorm = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return self.norm(prenorm), prenorm

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def draft(self, aux: torch.Tensor, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor]:
        """The greedy chain of k drafts after `tokens` (x_0..x_{n-1}), given the target's
        states `aux` [n - 1, 3 x target hidden] of x_0..x_{n-2}; and the first step's logits."""
        hidden = self.fc(aux)[None]
        ids = torch.tensor(tokens[1:])[None]
        out, first = [], None
        for _ in range(k):
            positions = torch.arange(ids.shape[1])[None]
            normed, prenorm = self(ids, hidden, positions)
            logits = self.lm_head(normed[0, -1])
            first = logits if first is None else first
            token = int(self.to_target(logits.argmax()))
            out.append(token)
            hidden = torch.cat([hidden, prenorm[:, -1:]], dim=1)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        return out, first

    def save_head(self, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().contiguous() for name, tensor in self.state_dict().items()
                 if not name.startswith("rotary.") and (self.own_embeddings or name != "embed_tokens.weight")}
        t2d = torch.zeros(self.config["vocab_size"], dtype=torch.bool)
        t2d[self.to_target(torch.arange(self.config["draft_vocab_size"]))] = True
        state["t2d"] = t2d
        save_file(state, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(self.config, indent=1))
        return path


def target_aux(target, tokens: list[int]) -> torch.Tensor:
    """The transformers target's states read by a head: [len(tokens), 3 x hidden]."""
    with torch.no_grad():
        states = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([states[j][0] for j in aux_layers(target.config.num_hidden_layers)], dim=-1)


def train_head(head: ReferenceEagle3, target, sequences: list[list[int]], steps: int, seed: int = 0) -> float:
    """Teach `head` the target's next-but-one token (pair (state at i, x_{i+1}) -> x_{i+2})
    on `sequences`; returns the last loss."""
    torch.manual_seed(seed)
    t2d = torch.full((head.config["vocab_size"],), -100, dtype=torch.int64)
    t2d[head.to_target(torch.arange(head.config["draft_vocab_size"]))] = torch.arange(head.config["draft_vocab_size"])
    data = [(target_aux(target, seq[:-2]), torch.tensor(seq[1:-1]), t2d[torch.tensor(seq[2:])]) for seq in sequences]
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    loss = torch.tensor(0.0)
    for step in range(steps):
        aux, ids, labels = data[step % len(data)]
        normed, _ = head(ids[None], head.fc(aux)[None], torch.arange(ids.shape[0])[None])
        loss = nn.functional.cross_entropy(head.lm_head(normed[0]), labels, ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.detach())
