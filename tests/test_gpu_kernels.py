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


def test_norms_silu_match_reference():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(37, 512, dtype=DTYPE, device=DEVICE, generator=g)
    r = torch.randn(37, 512, dtype=DTYPE, device=DEVICE, generator=g)
    w = torch.randn(512, dtype=DTYPE, device=DEVICE, generator=g)
    assert rel(triton_ops.rms_norm(x, w, 1e-5), ref_ops.rms_norm(x, w, 1e-5)) < TOL
    out, summed = triton_ops.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_summed = ref_ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, ref_summed)
    assert rel(out, ref_out) < TOL

    gu = torch.randn(37, 2 * 700, dtype=DTYPE, device=DEVICE, generator=g)
    assert rel(triton_ops.silu_and_mul(gu), ref_ops.silu_and_mul(gu)) < TOL


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(8, 2, 64), (4, 4, 128)])
def test_rotary_write_kv_matches_reference_and_skips_padding_slots(heads, kv_heads, d):
    g = torch.Generator(device=DEVICE).manual_seed(heads + d)
    t, page, blocks = 13, 4, 8
    cos, sin = cos_sin_table(RopeConfig(theta=10000.0), d, 4096, torch.device(DEVICE))
    # q, k, v as the projection leaves them: strided views of one fused row.
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, dtype=DTYPE, device=DEVICE, generator=g)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    pos = torch.randint(0, 4096, (t,), device=DEVICE, generator=g)
    slots = torch.randperm(blocks * page, device=DEVICE, generator=g)[:t]
    slots[[1, 5, 12]] = -1
    kc = torch.randn(blocks + 1, page, kv_heads, d, dtype=DTYPE, device=DEVICE, generator=g)
    vc = torch.randn_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    before = kc.clone(), vc.clone()

    tq, tk = triton_ops.rotary_write_kv(pos, q, k, v, kc, vc, slots, cos, sin)
    rq, rk = ref_ops.rotary_write_kv(pos, q, k, v, kc_ref, vc_ref, slots, cos, sin)
    assert rel(tq, rq) < TOL and rel(tk, rk) < TOL
    # Each real row holds the kernel's own rotated k and the untouched v; the torch path
    # parks padded rows in the scratch block, the kernel writes nothing for them.
    real = slots >= 0
    flat_k, flat_v = kc.view(-1, kv_heads, d), vc.view(-1, kv_heads, d)
    assert torch.equal(flat_k[slots[real]], tk[real]) and torch.equal(flat_v[slots[real]], v[real])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[real]] = False
    assert torch.equal(flat_k[untouched], before[0].view(-1, kv_heads, d)[untouched])
    assert torch.equal(flat_v[untouched], before[1].view(-1, kv_heads, d)[untouched])
    assert rel(kc[:blocks], kc_ref[:blocks]) < TOL and torch.equal(vc[:blocks], vc_ref[:blocks])


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
