"""The EAGLE-3 draft head: one decoder layer over the target's hidden states, with a
vocabulary of its own (Li et al. 2025; the published format, `hybridd.eagle3_head`).

For the token at position i of a sequence x_0 x_1 ..., the head reads the target's
residual stream at position i in three layers (concatenated, [3 x target hidden]), mixes
it down with `fc`, and pairs it with the embedding of the next token x_{i+1}: the decoder
layer's attention reads rmsnorm(embedding) and rmsnorm(hidden) side by side (q/k/v take
2 x hidden), its MLP and the final norm are Llama's, and `lm_head` scores the head's own
vocabulary, whose ids map to the target's by `d2t`. Its output at position i guesses
x_{i+2}. A further draft step feeds the head its own output (the stream before the final
norm, already of hidden size: no `fc`) with the embedding of the token it just drafted,
one position on. The layer keeps its keys and values in a paged KV cache of its own
(one layer), positioned like the target's tokens.

It runs eagerly with the torch kernels (the CPU reference; the drafter's home is the
context generator). The parameters carry the published tensor names, so a checkpoint
loads by name (`load_eagle3_head`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hybridd.eagle3_head import WEIGHTS, Eagle3HeadError, Eagle3HeadSpec, read_head
from hybridd.kernels import attention, ops
from hybridd.model.config import ModelConfig
from hybridd.model.errors import ModelLoadError
from hybridd.model.kv_cache import KVCache
from hybridd.model.llama import RMSNormWeight
from hybridd.model.loader import checkpoint_files
from hybridd.model.rope import cos_sin_table
from hybridd.model.step_inputs import StepInputs


class _Attention(nn.Module):
    def __init__(self, spec: Eagle3HeadSpec) -> None:
        super().__init__()
        h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.q_proj = nn.Linear(2 * h, q, bias=False)
        self.k_proj = nn.Linear(2 * h, kv, bias=False)
        self.v_proj = nn.Linear(2 * h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, spec: Eagle3HeadSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, spec: Eagle3HeadSpec) -> None:
        super().__init__()
        eps = spec.rms_norm_eps
        self.input_layernorm = RMSNormWeight(spec.hidden_size, eps)
        self.hidden_norm = RMSNormWeight(spec.hidden_size, eps)
        self.post_attention_layernorm = RMSNormWeight(spec.hidden_size, eps)
        self.self_attn = _Attention(spec)
        self.mlp = _MLP(spec)


class Eagle3Head(nn.Module):
    """The head's weights (published names), its RoPE table and its forward."""

    def __init__(self, spec: Eagle3HeadSpec, rope: tuple[torch.Tensor, torch.Tensor],
                 embed_tokens: nn.Embedding | None = None) -> None:
        """`embed_tokens`: the target's embedding, where the head has none of its own."""
        super().__init__()
        self.spec = spec
        self.rope = rope
        self.max_positions = rope[0].shape[0]
        self.scale = spec.head_dim ** -0.5
        self.fc = nn.Linear(3 * spec.target_hidden_size, spec.hidden_size, bias=False)
        self.midlayer = _MidLayer(spec)
        self.norm = RMSNormWeight(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False)
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(spec.vocab_size,
                                                                                       spec.hidden_size)
        # The target's id of each draft id (published as the offsets d2t: target = draft + d2t).
        self.register_buffer("draft_to_target", torch.arange(spec.draft_vocab_size), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def allocate_kv(self, num_blocks: int, block_size: int) -> KVCache:
        spec = self.spec
        arena = torch.zeros((1, 2, num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim),
                            dtype=self.dtype, device=self.device)
        return KVCache(arena, block_size)

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's three layers' hidden states [T, 3 x target hidden] mixed into the head's [T, hidden]."""
        return ops.linear(aux_hidden.to(self.dtype), self.fc.weight)

    def forward(self, step: StepInputs, kv_cache: KVCache, hidden: torch.Tensor,
                rope_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """For each row: `step.input_ids` the token after the one `hidden` [T, hidden] stands
        for (combined target states, or the head's own previous output). Returns (the
        normed output the logits read, the output before the final norm: the next step's
        `hidden`). `rope_positions` (default: `step.positions`) are the rows' positions in
        their sequences where the cache holds a sequence from a later position on
        (`step.positions` then count from there)."""
        spec, layer = self.spec, self.midlayer
        t = hidden.shape[0]
        embeds = ops.rms_norm(self.embed_tokens(step.input_ids).to(self.dtype), layer.input_layernorm.weight,
                              spec.rms_norm_eps)
        normed = ops.rms_norm(hidden, layer.hidden_norm.weight, spec.rms_norm_eps)
        residual = normed if spec.norm_before_residual else hidden
        x = torch.cat([embeds, normed], dim=-1)
        attn = layer.self_attn
        q = ops.linear(x, attn.q_proj.weight).view(t, spec.num_heads, spec.head_dim)
        k = ops.linear(x, attn.k_proj.weight).view(t, spec.num_kv_heads, spec.head_dim)
        v = ops.linear(x, attn.v_proj.weight).view(t, spec.num_kv_heads, spec.head_dim)
        k_cache, v_cache = kv_cache.layer(0)
        positions = step.positions if rope_positions is None else rope_positions
        q, _ = ops.rotary_write_kv(positions, q, k, v, k_cache, v_cache, step.slot_mapping, *self.rope)
        if step.is_prefill:
            o = attention.prefill_attention(q, k_cache, v_cache, step, self.scale)
        else:
            o = attention.decode_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens, self.scale)
        o = ops.linear(o.reshape(t, spec.num_heads * spec.head_dim), attn.o_proj.weight)
        x, residual = ops.add_rms_norm(o, residual, layer.post_attention_layernorm.weight, spec.rms_norm_eps)
        mlp = layer.mlp
        gate, up = ops.linear(x, mlp.gate_proj.weight), ops.linear(x, mlp.up_proj.weight)
        x = ops.linear(torch.nn.functional.silu(gate) * up, mlp.down_proj.weight)
        return ops.add_rms_norm(x, residual, self.norm.weight, spec.rms_norm_eps)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the head's vocabulary [T, draft vocab]."""
        return ops.linear(normed, self.lm_head.weight).float()


def load_eagle3_head(head_dir: str | Path, target: ModelConfig, target_dir: str | Path | None = None,
                     embed_tokens: nn.Embedding | None = None, max_positions: int | None = None,
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Eagle3Head:
    """The head in `head_dir` for the model of config `target`, checked against it
    (`Eagle3HeadError` names what does not fit). A head without embeddings of its own uses
    the model's: `embed_tokens` (the loaded model's, used as it is where it has this dtype
    and device) or the tensor read from the checkpoint in `target_dir`. The RoPE table
    covers `max_positions` (default: the model's)."""
    head_dir = Path(head_dir)
    spec = read_head(head_dir, target.raw)
    try:
        rope = ModelConfig.from_dict({**spec.config, "architectures": ["LlamaForCausalLM"]},
                                     str(head_dir / "config.json")).rope
    except ModelLoadError as error:
        raise Eagle3HeadError(str(error)) from None
    rope_table = cos_sin_table(rope, spec.head_dim, max_positions or target.max_model_len, torch.device(device))
    shared = None
    if not spec.has_embeddings:
        if embed_tokens is not None and embed_tokens.weight.dtype == dtype and \
                embed_tokens.weight.device == torch.device(device):
            shared = embed_tokens
        else:
            shared = nn.Embedding(spec.vocab_size, spec.hidden_size, device=device, dtype=dtype)
            with torch.no_grad():
                shared.weight.copy_(embed_tokens.weight if embed_tokens is not None else _target_embeddings(target_dir))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = Eagle3Head(spec, rope_table, shared)
    finally:
        torch.set_default_dtype(previous)
    params = dict(head.named_parameters())
    path = head_dir / WEIGHTS
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle, torch.no_grad():
            for stored in handle.keys():
                name = stored.removeprefix("model.")
                if name == "t2d":
                    continue
                tensor = handle.get_tensor(stored)
                if name == "d2t":
                    head.draft_to_target.add_(tensor.to(head.draft_to_target.device, torch.int64))
                elif name in params:
                    params[name].copy_(tensor)
                else:
                    raise Eagle3HeadError(f"{path}: unexpected tensor {stored!r} for an EAGLE-3 head")
    except (SafetensorError, OSError, RuntimeError) as error:
        raise Eagle3HeadError(f"{path}: cannot read its tensors ({error})") from None
    ids = head.draft_to_target
    if spec.draft_vocab_size and (int(ids.min()) < 0 or int(ids.max()) >= spec.vocab_size):
        raise Eagle3HeadError(f"{path}: d2t maps draft ids to {int(ids.min())}..{int(ids.max())}, outside the "
                              f"model's vocabulary of {spec.vocab_size}")
    return head.eval()


def _target_embeddings(target_dir: str | Path | None) -> torch.Tensor:
    if target_dir is None:
        raise Eagle3HeadError("the EAGLE-3 head has no embed_tokens and no model embedding was given")
    name = "model.embed_tokens.weight"
    path = checkpoint_files(Path(target_dir)).get(name)
    if path is None:
        raise Eagle3HeadError(f"{target_dir}: the model's checkpoint lacks {name!r}, which the EAGLE-3 head "
                              f"embeds with")
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return handle.get_tensor(name)
