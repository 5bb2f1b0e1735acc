"""Where the Triton kernel tests run: on the GPU in bf16, or on the CPU through Triton's
interpreter (TRITON_INTERPRET=1) in float32, the same kernel source either way."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32


def require_triton() -> None:
    """Skip the calling test module unless its kernels can run here."""
    pytest.importorskip("triton")
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of `a` against `b`, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
