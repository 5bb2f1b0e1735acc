"""The Llama-family Transformer (Llama 2/3, Mistral, Qwen2) with fused projections,
written for graph capture: no host syncs, no data-dependent shapes inside `forward`.

Attention goes through an `AttentionBackend` so the GPU runtime can swap in its
graph-safe kernels while the plain torch path stays the reference.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridd.model import attention as torch_attention
from hybridd.model.config import ModelConfig
from hybridd.model.kv_cache import KVCache
from hybridd.model.rope import RotaryEmbedding
from hybridd.model.step_inputs import StepInputs


class AttentionBackend(Protocol):
    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None: ...
    def prefill(self, q, k, v, step: StepInputs, scale: float) -> torch.Tensor: ...
    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor: ...


class TorchAttention:
    """The plain torch attention path (CPU, and the reference for GPU kernels)."""

    write_kv = staticmethod(torch_attention.write_kv)
    prefill = staticmethod(torch_attention.prefill_attention)
    decode = staticmethod(torch_attention.decode_attention)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        step: StepInputs,
        kv_cache: KVCache,
        rotary: RotaryEmbedding,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        t = hidden.shape[0]
        residual = hidden
        x = self.input_layernorm(hidden)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(step.positions, q, k)
        k_cache, v_cache = kv_cache.layer(self.index)
        attn.write_kv(k_cache, v_cache, k, v, step.slot_mapping)
        if step.is_prefill:
            o = attn.prefill(q, k, v, step, self.scale)
        else:
            o = attn.decode(q, k_cache, v_cache, step.block_tables, step.seq_lens, self.scale)
        hidden = residual + self.o_proj(o.reshape(t, self.q_size))
        residual = hidden
        gate, up = self.gate_up_proj(self.post_attention_layernorm(hidden)).chunk(2, dim=-1)
        return residual + self.down_proj(F.silu(gate) * up)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.max_positions = max_positions or config.max_model_len
        self.rotary: RotaryEmbedding | None = None
        self.attention: AttentionBackend = TorchAttention()

    def init_rotary(self, device: torch.device) -> None:
        """Build the cos/sin table on the weights' device (after loading from meta)."""
        self.rotary = RotaryEmbedding(self.config.rope, self.config.head_dim, self.max_positions, device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, step: StepInputs, kv_cache: KVCache) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the step."""
        hidden = self.embed_tokens(step.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, step, kv_cache, self.rotary, self.attention)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits for the rows that need them (each sequence's last token)."""
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.lm_head(hidden).float()

    def forward_logits(self, step: StepInputs, kv_cache: KVCache) -> torch.Tensor:
        return self.compute_logits(self.forward(step, kv_cache), step.logits_indices)
