"""The fused Triton kernels against the torch reference: on the GPU in bf16, and on
the CPU through Triton's interpreter in float32 (the same kernel source)."""

from __future__ import annotations

import os

import pytest
import torch

from hybridd.model import attention as ref_attention
from hybridd.model import ops as ref_ops
from hybridd.model.config import RopeConfig
from hybridd.model.rope import cos_sin_table

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from hybridd.model import triton_attention, triton_ops  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
# bf16 outputs may differ by one rounding step where float32 reduction order differs.
TOL = 2e-2 if CUDA else 1e-5


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_norms_rotary_silu_match_reference():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(37, 512, dtype=DTYPE, device=DEVICE, generator=g)
    r = torch.randn(37, 512, dtype=DTYPE, device=DEVICE, generator=g)
    w = torch.randn(512, dtype=DTYPE, device=DEVICE, generator=g)
    assert rel(triton_ops.rms_norm(x, w, 1e-5), ref_ops.rms_norm(x, w, 1e-5)) < TOL
    out, summed = triton_ops.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_summed = ref_ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, ref_summed)
    assert rel(out, ref_out) < TOL

    cos, sin = cos_sin_table(RopeConfig(theta=10000.0), 64, 4096, torch.device(DEVICE))
    qkv = torch.randn(37, 8 * 64 + 2 * 2 * 64, dtype=DTYPE, device=DEVICE, generator=g)
    q, k, _ = qkv.split([512, 128, 128], dim=-1)
    q, k = q.view(37, 8, 64), k.view(37, 2, 64)
    pos = torch.randint(0, 4096, (37,), device=DEVICE, generator=g)
    tq, tk = triton_ops.rotary(pos, q, k, cos, sin)
    rq, rk = ref_ops.rotary(pos, q, k, cos, sin)
    assert rel(tq, rq) < TOL and rel(tk, rk) < TOL

    gu = torch.randn(37, 2 * 700, dtype=DTYPE, device=DEVICE, generator=g)
    assert rel(triton_ops.silu_and_mul(gu), ref_ops.silu_and_mul(gu)) < TOL


def test_write_kv_skips_padding_slots():
    kc = torch.randn(9, 4, 2, 64, dtype=DTYPE, device=DEVICE)
    vc = torch.randn_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k = torch.randn(6, 2, 64, dtype=DTYPE, device=DEVICE)
    v = torch.randn_like(k)
    slots = torch.tensor([3, -1, 17, 0, -1, 31], device=DEVICE)
    triton_ops.write_kv(kc, vc, k, v, slots)
    ref_attention.write_kv(kc_ref, vc_ref, k, v, slots)
    # The torch path parks padded rows in the scratch block; real blocks must agree.
    assert torch.equal(kc[:8], kc_ref[:8]) and torch.equal(vc[:8], vc_ref[:8])


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2), (32, 8)])
@pytest.mark.parametrize("page", [16, 4])
def test_decode_attention_matches_reference(heads, kv_heads, page):
    g = torch.Generator(device=DEVICE).manual_seed(heads * 100 + page)
    d = 64 if not CUDA else 128
    blocks = 300
    kc = torch.randn(blocks + 1, page, kv_heads, d, dtype=DTYPE, device=DEVICE, generator=g)
    vc = torch.randn_like(kc)
    lens = [1, 2, page, page + 1, 63, 64, 65, 300, 777] if CUDA else [1, page + 1, 65, 130]
    width = max(-(-n // page) for n in lens)
    tables = torch.stack([torch.randperm(blocks, device=DEVICE, generator=g)[:width] for _ in lens]).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), heads, d, dtype=DTYPE, device=DEVICE, generator=g)
    out = triton_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
    ref = ref_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
    assert rel(out, ref) < (1e-2 if CUDA else 1e-5)
    # Zero-length rows (bucket padding) give zeros, never NaN.
    seq_lens[0] = 0
    out = triton_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
    assert not out.isnan().any() and out[0].abs().sum() == 0
