"""Choosing the per-layer kernels: fused Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import contextlib

import torch

from hybridd.kernels.choices import KernelChoices
from hybridd.kernels.fp8 import Fp8Weight
from hybridd.kernels.ops import ComposedSteps, TorchKernels
from hybridd.kernels.residual_stream import ResidualStream
from hybridd.kernels.rotary import RotaryArgs


class TritonKernels(ComposedSteps):
    """Fused Triton kernels for norms, RoPE with the KV write, SiLU·mul, paged attention
    (prefill over the packed step, decode over block tables; no sliding window) and the
    projections of a few token rows (cuBLAS for more rows). Where a step's projection runs
    on the skinny kernel, its neighbours named in `choices.fusions` run inside it: the
    residual add and the norm, RoPE with the KV write (not with an FP8 KV cache: the
    separate RoPE kernel quantizes the cache). Where it runs on cuBLAS with the
    norms folded, cuBLAS adds o's and down's products to the stream, and RoPE and SiLU·mul
    apply the norm's row scales.

    FP8 weights (`Fp8Weight`) run on `triton_fp8`: the skinny GEMM for decode, with the
    same fusions, except that the norm's weight stays out of the FP8 weight (which has
    scales per output row) and the kernel applies the whole norm to the activations it
    loads (`FoldedNorm.weight`; not where the checkpoint quantizes the activations: their
    scale is taken from the normalised row, so the norm runs first). More rows go to the
    FP8 × FP8 prefill (`triton_fp8.prefill_scaled_mm`) with the norm and the residual add
    as separate kernels: no product of more rows adds into the stream or applies row scales
    after."""

    name = "triton"
    # FP8 products of more rows than decode's quantize their activations per token
    # (`triton_fp8.prefill_scaled_mm`), whatever the scheme says.
    fp8_prefill_per_token = True

    def __init__(self, choices: KernelChoices = KernelChoices()) -> None:
        from hybridd.kernels import pdl, triton_attention, triton_fp8, triton_gemm, triton_ops

        self.choices = choices
        self.fusions = choices.fusions

        # Projections of up to this many token rows may run on the skinny kernel, not cuBLAS.
        self.skinny_rows = triton_gemm.MAX_ROWS
        self.rms_norm = triton_ops.rms_norm
        self.add_rms_norm = triton_ops.add_rms_norm
        self.rotary_write_kv = triton_ops.rotary_write_kv
        self.norm_rotary_write_kv = triton_ops.norm_rotary_write_kv
        self.silu_and_mul = triton_ops.silu_and_mul
        self.norm_silu_and_mul = triton_ops.norm_silu_and_mul
        self.prefill_attention = triton_attention.prefill_attention
        self.decode_attention = triton_attention.decode_attention
        self._gemm = triton_gemm
        self._fp8 = triton_fp8
        self._pdl = pdl
        # Set by `LlamaModel.fold_norms`: the norms before qkv and gate/up have unit weights,
        # theirs being folded into those projections, so the projections may apply them.
        self.norms_folded = False

    def launches(self, num_tokens: int) -> contextlib.AbstractContextManager:
        """The launch settings of a step of `num_tokens` rows: without programmatic
        dependent launch where the choices turn it off or the step's projections run on
        cuBLAS."""
        if num_tokens > self.skinny_rows or not self.choices.pdl:
            return self._pdl.off()
        return contextlib.nullcontext()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`triton_gemm.linear` (an FP8 weight: `triton_fp8.linear`) under this kernel set's
        launch settings for x's rows (it is also called outside a step's `launches`: the LM head)."""
        with self.launches(x.shape[0]):
            if isinstance(weight, Fp8Weight):
                return self._fp8.linear(x, weight, bias)
            return self._gemm.linear(x, weight, bias)

    def linear_silu_and_mul(self, x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
        """silu(x @ W_gate.T) * (x @ W_up.T) of a fused gate_up weight: `linear`, then SiLU·mul."""
        return self.silu_and_mul(self.linear(x, weight))

    def _input(self, stream: ResidualStream, norm_weight: torch.Tensor, eps: float, weight):
        """(the rows a projection of `weight` reads, the stream's value, the folded norm it
        applies itself, or None where those rows are normalised already)."""
        if self.norms_folded and stream.update is None and stream.sum_squares is not None:
            if not isinstance(weight, Fp8Weight):
                return stream.base, stream.base, self._gemm.FoldedNorm(eps, stream.sum_squares)
            if weight.activations == "none":
                return stream.base, stream.base, self._gemm.FoldedNorm(eps, stream.sum_squares, norm_weight)
        x, base = self.stream_norm(stream, norm_weight, eps)
        return x, base, None

    def _normalised(self, x: torch.Tensor, norm, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x's rows normalised here, where the projection could not apply `norm` itself."""
        return x if norm is None else self.rms_norm(x, weight, eps)

    def _scaled_after(self, stream: ResidualStream, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether this projection of the normalised stream runs on cuBLAS over the stream's
        rows as they are, and the kernel after it (RoPE with the KV write, SiLU·mul) scales
        each row of the product by the row's 1 / rms: there is no norm kernel. So where the
        norm's weight is folded into the projection's, the stream is one tensor without its
        sums of squares (an embedding, or a sum cuBLAS formed, see `linear_add`), there is
        no bias (a sum with it would not scale), the weight is not FP8 (the norm's weight is
        not in it) and the skinny kernel takes no such product."""
        return (self.norms_folded and bias is None and stream.update is None and stream.sum_squares is None
                and not isinstance(weight, Fp8Weight) and self._gemm.config_of(stream.base.shape[0], weight) is None)

    def norm_qkv(self, stream, norm_weight, eps, weight, bias, rotary: RotaryArgs):
        if rotary.qk_norm is not None:
            # The heads' norm sits between the projection and RoPE: no epilogue fuses it.
            return super().norm_qkv(stream, norm_weight, eps, weight, bias, rotary)
        if self._scaled_after(stream, weight, bias):
            q, k, v = rotary.split_qkv(self.linear(stream.base, weight))
            q, k, v = self.norm_rotary_write_kv(stream.base, eps, q, k, v, rotary)
            return q, k, v, stream.base
        x, base, norm = self._input(stream, norm_weight, eps, weight)
        # The epilogue writes the cache in the model's dtype: an FP8 cache is written by the
        # separate kernel, which quantizes.
        fuse_rotary = "rotary" in self.fusions and rotary.k_scale is None
        qkv = self._gemm.skinny(x, weight, bias, norm=norm, rotary=rotary if fuse_rotary else None)
        if qkv is None:
            fuse_rotary = False
            qkv = self.linear(self._normalised(x, norm, norm_weight, eps), weight, bias)
        q, k, v = rotary.split_qkv(qkv)
        if not fuse_rotary:
            q, k = self.rotary_write_kv(rotary.positions, q, k, v, rotary.k_cache, rotary.v_cache,
                                        rotary.slot_mapping, rotary.cos, rotary.sin, **rotary.scales)
        return q, k, v, base

    def norm_gate_up(self, stream, norm_weight, eps, weight):
        if self._scaled_after(stream, weight, None):
            return self.norm_silu_and_mul(stream.base, eps, self.linear(stream.base, weight)), stream.base
        x, base, norm = self._input(stream, norm_weight, eps, weight)
        y = self._gemm.skinny(x, weight, None, norm=norm)
        if y is None:
            return self.linear_silu_and_mul(self._normalised(x, norm, norm_weight, eps), weight), base
        return self.silu_and_mul(y), base

    def linear_add(self, x, weight, bias, base) -> ResidualStream:
        if self.norms_folded:
            out = self._gemm.skinny(x, weight, bias, residual=base.contiguous())
            if out is not None:
                summed, sum_squares = out
                return ResidualStream(summed, None, sum_squares)
            if bias is None and base.is_contiguous() and not isinstance(weight, Fp8Weight):
                # cuBLAS adds the product to the stream in its epilogue (beta = 1), in place
                # (out of place, torch would first copy the stream in a kernel of its own),
                # so the next projection can read the sum as it is (`_scaled_after`).
                base.addmm_(x, weight.t())
                return ResidualStream(base)
        return super().linear_add(x, weight, bias, base)


Kernels = TorchKernels | TritonKernels


def select_kernels(device: torch.device | str, choices: KernelChoices | str = KernelChoices()) -> Kernels:
    """The kernel set `choices` names for `device` (a backend name alone: "auto", Triton
    on CUDA, "triton" or "torch", with the default fusions and PDL)."""
    if isinstance(choices, str):
        choices = KernelChoices(choices)
    device = torch.device(device)
    if choices.backend == "torch" or (choices.backend == "auto" and device.type != "cuda"):
        return TorchKernels()
    return TritonKernels(choices)
