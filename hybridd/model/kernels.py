"""Choosing the per-layer kernels: fused Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from hybridd.model.ops import TorchKernels


class TritonKernels:
    """Fused Triton kernels for norms, RoPE with the KV write, SiLU·mul, paged attention
    (prefill over the packed step, decode over block tables; no sliding window) and the
    projections of a few token rows (cuBLAS for more rows, or where it is faster), the
    gate/up projection with SiLU·mul in its epilogue."""

    name = "triton"

    def __init__(self) -> None:
        from hybridd.model import triton_attention, triton_gemm, triton_ops

        # Projections of up to this many token rows may run on the skinny kernel, not cuBLAS.
        self.skinny_rows = triton_gemm.MAX_ROWS
        self.rms_norm = triton_ops.rms_norm
        self.add_rms_norm = triton_ops.add_rms_norm
        self.rotary_write_kv = triton_ops.rotary_write_kv
        self.silu_and_mul = triton_ops.silu_and_mul
        self.linear = triton_gemm.linear
        self.linear_silu_and_mul = triton_gemm.linear_silu_and_mul
        self.prefill_attention = triton_attention.prefill_attention
        self.decode_attention = triton_attention.decode_attention


Kernels = TorchKernels | TritonKernels
KERNEL_CHOICES = ("auto", "triton", "torch")


def select_kernels(device: torch.device | str, prefer: str = "auto") -> Kernels:
    """`prefer` is "auto" (Triton on CUDA), "triton" or "torch"."""
    if prefer not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {prefer!r}")
    device = torch.device(device)
    if prefer == "torch" or (prefer == "auto" and device.type != "cuda"):
        return TorchKernels()
    return TritonKernels()
