"""The per-layer operations of the forward in plain torch: the CPU path and the reference.

The GPU runtime supplies fused Triton versions with the same signatures and the same
rounding points (`hybridd/kernels/triton_ops.py`); `LlamaModel.kernels` selects one.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hybridd.kernels import attention, fp8
from hybridd.kernels.residual_stream import ResidualStream
from hybridd.kernels.rotary import RotaryArgs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), the sum rounded to the activation dtype first."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, H, d] and k [T, KVH, d], in the activation dtype."""
    c = cos[positions].to(q.dtype).unsqueeze(1)
    s = sin[positions].to(q.dtype).unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def rotary_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q and k, then the rotated k and v stored at their slots (quantized, with an
    FP8 cache's scales); returns (q, k) rotated."""
    q, k = rotary(positions, q, k, cos, sin)
    attention.write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    return q, k


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor | fp8.Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias); an FP8 weight (`fp8.Fp8Weight`) with its numerics emulated in float32."""
    if isinstance(weight, fp8.Fp8Weight):
        return fp8.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """The MLP's input to its down projection: SiLU·mul of the fused gate/up projection."""
    return silu_and_mul(linear(x, gate_up_weight))


class ComposedSteps:
    """A layer's steps between its attention and its MLP, composed from the primitive
    kernels (`rms_norm`, `add_rms_norm`, `linear`, ...) of the class they are mixed into.
    The Triton kernels fuse each step into one projection where they can and fall back
    to these compositions where they cannot."""

    def stream_norm(self, stream: ResidualStream, weight: torch.Tensor, eps: float):
        """(RMSNorm of the stream's value, that value as one tensor)."""
        if stream.update is None:
            return self.rms_norm(stream.base, weight, eps), stream.base
        return self.add_rms_norm(stream.update, stream.base, weight, eps)

    def norm_qkv(
        self, stream: ResidualStream, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
        bias: torch.Tensor | None, rotary: RotaryArgs,
    ):
        """The attention's input: (q [T, H, d] and k [T, KVH, d] rotated, v [T, KVH, d], the
        stream's value), the fused qkv projection of the normalised stream (each head of q
        and k normalised where the model has a qk norm), with k and v stored in the KV
        caches at their slots."""
        x, base = self.stream_norm(stream, norm_weight, eps)
        q, k, v = rotary.split_qkv(self.linear(x, weight, bias))
        if rotary.qk_norm is not None:
            q_weight, k_weight, qk_eps = rotary.qk_norm
            q, k = self.rms_norm(q, q_weight, qk_eps), self.rms_norm(k, k_weight, qk_eps)
        q, k = self.rotary_write_kv(
            rotary.positions, q, k, v, rotary.k_cache, rotary.v_cache, rotary.slot_mapping, rotary.cos, rotary.sin,
            **rotary.scales,
        )
        return q, k, v, base

    def norm_gate_up(self, stream: ResidualStream, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor):
        """The MLP's input to its down projection, SiLU·mul of the fused gate/up projection
        of the normalised stream, and the stream's value."""
        x, base = self.stream_norm(stream, norm_weight, eps)
        return self.linear_silu_and_mul(x, weight), base

    def linear_add(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, base: torch.Tensor
    ) -> ResidualStream:
        """The stream after a projection whose output joins it (o_proj, down_proj)."""
        return ResidualStream(base, self.linear(x, weight, bias))

    def mlp(self, stream: ResidualStream, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
            down_weight: torch.Tensor) -> ResidualStream:
        """The stream after the MLP: down(SiLU·mul(gate/up(norm(stream)))) joins it."""
        x, base = self.norm_gate_up(stream, norm_weight, eps, gate_up_weight)
        return self.linear_add(x, down_weight, None, base)


class TorchKernels(ComposedSteps):
    """The plain torch implementation of every per-layer operation."""

    name = "torch"
    # FP8 products keep the scheme's numerics at every row count (`fp8.linear`).
    fp8_prefill_per_token = False
    supports_sliding_window = True
    skinny_rows = 0  # every projection goes to torch's matmul (cuBLAS on CUDA)
    fusions: frozenset[str] = frozenset()  # no projection computes a neighbour
    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rotary_write_kv = staticmethod(rotary_write_kv)
    silu_and_mul = staticmethod(silu_and_mul)
    linear = staticmethod(linear)
    linear_silu_and_mul = staticmethod(linear_silu_and_mul)
    prefill_attention = staticmethod(attention.prefill_attention)
    decode_attention = staticmethod(attention.decode_attention)

    def launches(self, num_tokens: int) -> contextlib.AbstractContextManager:
        """The launch settings of a step of `num_tokens` rows (torch's own, always)."""
        return contextlib.nullcontext()
