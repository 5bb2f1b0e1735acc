"""The Llama-family Transformer (Llama 2/3, Mistral, Qwen2, Qwen3 dense) with fused projections,
written for graph capture: no host syncs, no data-dependent shapes inside `forward`.

The model builds what it needs from its config and its device: the kernels (fused
Triton on CUDA, plain torch elsewhere, with identical rounding points, so the torch path
is the reference) and the RoPE cos/sin tables for `max_positions`. Each layer is handed
those at every call; no layer reaches back into the model.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridd.model.config import ModelConfig
from hybridd.kernels.fp8 import FP8_DTYPE
from hybridd.model.projections import projection
from hybridd.quantization import Quantization
from hybridd.model.errors import ModelLoadError, SequenceTooLongError
from hybridd.kernels.selection import Kernels, select_kernels
from hybridd.model.kv_cache import KVCache
from hybridd.kernels.residual_stream import ResidualStream
from hybridd.kernels.rotary import RotaryArgs
from hybridd.model.rope import cos_sin_table
from hybridd.model.step_inputs import StepInputs


class RMSNormWeight(nn.Module):
    """Holds a norm's weight; the computation is one of the kernels' norm functions."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, sliding_window: int | None = None,
                 quantization: Quantization | None = None):
        super().__init__()
        self.index = index
        # Attention over the last `sliding_window` positions only (None: simply causal).
        self.window = {} if sliding_window is None else {"sliding_window": sliding_window}
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.scale = config.head_dim**-0.5
        self.input_layernorm = RMSNormWeight(config.hidden_size, config.rms_norm_eps)
        fp8 = None if quantization is None else quantization.activations
        h, i = config.hidden_size, config.intermediate_size
        self.qkv_proj = projection(h, config.q_size + 2 * config.kv_size, config.qkv_bias, fp8, parts=3)
        self.o_proj = projection(config.q_size, h, config.o_bias, fp8)
        self.post_attention_layernorm = RMSNormWeight(config.hidden_size, config.rms_norm_eps)
        if config.qk_norm:
            self.q_norm = RMSNormWeight(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNormWeight(config.head_dim, config.rms_norm_eps)
        self.gate_up_proj = projection(h, 2 * i, False, fp8, parts=2)
        self.down_proj = projection(i, h, False, fp8)

    def forward(
        self,
        stream: ResidualStream,
        step: StepInputs,
        kv_cache: KVCache,
        ops: Kernels,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> ResidualStream:
        t = stream.base.shape[0]
        k_cache, v_cache = kv_cache.layer(self.index)
        scales = kv_cache.layer_scales(self.index)
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if hasattr(self, "q_norm") else None
        rotary = RotaryArgs(self.num_heads, self.num_kv_heads, self.head_dim, step.positions, step.slot_mapping,
                            k_cache, v_cache, *rope, qk_norm, **scales)
        norm = self.input_layernorm
        q, k, v, base = ops.norm_qkv(stream, norm.weight, norm.eps, self.qkv_proj.operand, self.qkv_proj.bias, rotary)
        if step.is_prefill:
            o = ops.prefill_attention(q, k_cache, v_cache, step, self.scale, **self.window, **scales, k=k, v=v)
        else:
            o = ops.decode_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens, self.scale,
                                     **self.window, **scales)
        stream = ops.linear_add(o.reshape(t, self.q_size), self.o_proj.operand, self.o_proj.bias, base)
        norm = self.post_attention_layernorm
        return ops.mlp(stream, norm.weight, norm.eps, self.gate_up_proj.operand, self.down_proj.operand)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
        kernels: str = "auto",
        quantization: Quantization | None = None,
    ):
        """The weights are created on the current default device (meta, when loading);
        the kernels and the RoPE tables are for `device`. `max_positions` (default: the
        config's own limit) bounds the positions the tables cover; `kernels` is "auto"
        (Triton on CUDA), "triton" or "torch"; `quantization` (default: the checkpoint's)
        makes the decoder's projections FP8."""
        super().__init__()
        self.config = config
        self.quantization = quantization if quantization is not None else config.quantization
        self.max_positions = max_positions or config.max_model_len
        window = config.sliding_window
        # The attention window, when sequences can outgrow it (else attention is simply causal).
        self.sliding_window = window if window is not None and self.max_positions > window else None
        self.kernels: Kernels = select_kernels(device, kernels)
        self.rope = cos_sin_table(config.rope, config.head_dim, self.max_positions, torch.device(device))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.sliding_window, self.quantization)
                                    for i in range(config.num_layers))
        self.norm = RMSNormWeight(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.no_grad()
    def fold_norms(self) -> None:
        """Fold each layer's norm weights into the projection that reads the norm (W diag(g))
        and make the norm's weight ones: the same function, rounded differently, whose norms
        are one scale per row, which the Triton kernels apply inside the projections (the
        `norm` fusion). Done once, after the weights are loaded; the final norm stays.

        FP8 projections keep their weights and their norms theirs: an FP8 weight's scales
        are per output row, the norm's weight per input column, so W diag(g) would have to
        be quantized again (other numbers than the checkpoint's). The kernels apply such a
        norm whole, on the activation side, inside the projection (`FoldedNorm.weight`)."""
        for layer in self.layers:
            for norm, proj in ((layer.input_layernorm, layer.qkv_proj),
                               (layer.post_attention_layernorm, layer.gate_up_proj)):
                if proj.weight.dtype == FP8_DTYPE:
                    continue
                proj.weight.mul_(norm.weight.to(proj.weight.dtype)[None, :])
                norm.weight.fill_(1.0)
        if hasattr(self.kernels, "norms_folded"):
            self.kernels.norms_folded = True

    def check_sequence_length(self, length: int) -> None:
        """Refuse a sequence of `length` tokens that the RoPE table cannot position."""
        if length > self.max_positions:
            raise SequenceTooLongError(
                f"a sequence of {length} tokens reaches position {length - 1}, past max_positions {self.max_positions} "
                f"of this model (the longest sequence it was loaded for; see load_model's max_positions)"
            )

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, step: StepInputs, kv_cache: KVCache) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the step."""
        return self._forward(step, kv_cache, ())[0]

    def forward_aux(self, step: StepInputs, kv_cache: KVCache,
                    aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the residual stream after each of `aux_layers` layers (0: the
        embeddings; `num_layers`: the last layer's output before the final norm), side by
        side [T, len(aux_layers) x hidden]: what an EAGLE-3 head reads."""
        hidden, aux = self._forward(step, kv_cache, aux_layers)
        return hidden, torch.cat(aux, dim=-1)

    def _forward(self, step: StepInputs, kv_cache: KVCache,
                 aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.sliding_window is not None and not getattr(self.kernels, "supports_sliding_window", False):
            raise ModelLoadError(
                f"sliding_window {self.sliding_window} is shorter than max_positions {self.max_positions} and the "
                f"{self.kernels.name} kernels do not implement sliding-window attention; use the torch kernels or "
                f"max_positions <= {self.sliding_window}"
            )
        if step.positions.device.type == "cpu" and step.num_tokens:
            # Checked where it is free; on CUDA callers check lengths on the host (the
            # scheduler's max_model_len, greedy_generate) instead of syncing here.
            self.check_sequence_length(int(step.positions.max()) + 1)
        with self.kernels.launches(step.num_tokens):
            stream = ResidualStream(self.embed_tokens(step.input_ids))
            aux: dict[int, torch.Tensor] = {}
            for index, layer in enumerate(self.layers):
                if index in aux_layers:
                    aux[index] = _stream_value(stream)
                stream = layer(stream, step, kv_cache, self.kernels, self.rope)
            if len(self.layers) in aux_layers:
                aux[len(self.layers)] = _stream_value(stream)
            hidden, _ = self.kernels.stream_norm(stream, self.norm.weight, self.norm.eps)
        return hidden, [aux[index] for index in aux_layers]

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits for the rows that need them (each sequence's last token)."""
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.kernels.linear(hidden, self.lm_head.weight).float()

    def forward_logits(self, step: StepInputs, kv_cache: KVCache) -> torch.Tensor:
        return self.compute_logits(self.forward(step, kv_cache), step.logits_indices)


def _stream_value(stream: ResidualStream) -> torch.Tensor:
    """The residual stream's value as one tensor (as the next norm adds it)."""
    return stream.base if stream.update is None else stream.base + stream.update
