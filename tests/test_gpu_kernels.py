"""The fused Triton kernels against the torch reference: on the GPU in bf16, and on
the CPU through Triton's interpreter in float32 (the same kernel source). The tests
marked `gpu` sweep the shapes of the supported models on the GPU only."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import statistics
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridd.kernels import attention as ref_attention
from hybridd.kernels import ops as ref_ops
from hybridd.model.config import RopeConfig
from hybridd.kernels.rotary import RotaryArgs
from hybridd.model.rope import cos_sin_table
from hybridd.model.step_inputs import StepInputs
from tests.paged_steps import dense_causal, paged_step, poison_step_slots, step_kv
from tests.triton_target import CUDA, DEVICE, DTYPE, rel, require_triton

require_triton()

from hybridd.kernels import triton_attention, triton_ops  # noqa: E402

# bf16 outputs may differ by one rounding step where float32 reduction order differs.
TOL = 2e-2 if CUDA else 1e-5


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


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(8, 2, 64), (4, 4, 128), (12, 6, 64)])
def test_rotary_write_kv_matches_reference_and_skips_padding_slots(heads, kv_heads, d, splits, monkeypatch):
    monkeypatch.setattr(triton_ops, "ROTARY_SPLITS", splits)  # each token's heads over this many programs
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


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(8, 2, 64), (4, 4, 128)])
def test_row_norm_after_the_product_matches_norm_then_product(heads, kv_heads, d, splits, monkeypatch):
    """RoPE with the KV write, and SiLU·mul, applying the RMSNorm of the rows the product
    was taken of (its weight folded into W): q, k, v, both caches and SiLU·mul equal the
    reference's norm, then product, then kernel."""
    monkeypatch.setattr(triton_ops, "ROTARY_SPLITS", splits)
    g = torch.Generator(device=DEVICE).manual_seed(heads + d + 1)
    t, page, blocks, hidden, eps = 13, 4, 8, 96, 1e-5
    cos, sin = cos_sin_table(RopeConfig(theta=10000.0), d, 4096, torch.device(DEVICE))
    # Rows far from unit scale, each its own: an unapplied or misplaced norm cannot pass.
    x = torch.randn(t, hidden, dtype=DTYPE, device=DEVICE, generator=g) * torch.logspace(
        -1, 2, t, device=DEVICE, dtype=DTYPE)[:, None]
    ones = torch.ones(hidden, dtype=DTYPE, device=DEVICE)
    w_qkv = torch.randn((heads + 2 * kv_heads) * d, hidden, dtype=DTYPE, device=DEVICE, generator=g) / hidden**0.5
    pos = torch.randint(0, 4096, (t,), device=DEVICE, generator=g)
    slots = torch.randperm(blocks * page, device=DEVICE, generator=g)[:t]
    slots[[2, 7]] = -1
    caches = [torch.zeros(blocks + 1, page, kv_heads, d, dtype=DTYPE, device=DEVICE) for _ in range(4)]

    def split(qkv):
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        return q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)

    rotary = RotaryArgs(heads, kv_heads, d, pos, slots, caches[0], caches[1], cos, sin)
    tq, tk, tv = triton_ops.norm_rotary_write_kv(x, eps, *split(x @ w_qkv.T), rotary)
    rq, rk, rv = split(ref_ops.rms_norm(x, ones, eps) @ w_qkv.T)
    rq, rk = ref_ops.rotary_write_kv(pos, rq, rk, rv, caches[2], caches[3], slots, cos, sin)
    assert rel(tq, rq) < TOL and rel(tk, rk) < TOL and rel(tv, rv) < TOL
    assert rel(caches[0][:blocks], caches[2][:blocks]) < TOL and rel(caches[1][:blocks], caches[3][:blocks]) < TOL
    assert caches[1][:blocks].abs().sum() > 0  # v reached the cache
    assert not caches[0][blocks].any() and not caches[1][blocks].any()  # padding slots wrote nothing

    w_gate_up = torch.randn(2 * 160, hidden, dtype=DTYPE, device=DEVICE, generator=g) / hidden**0.5
    fused = triton_ops.norm_silu_and_mul(x, eps, x @ w_gate_up.T)
    assert rel(fused, ref_ops.silu_and_mul(ref_ops.rms_norm(x, ones, eps) @ w_gate_up.T)) < TOL

    # Norm rows that are not one per token, or not contiguous, are refused before any launch.
    with pytest.raises(ValueError, match=r"x must hold one row per token \(13\)"):
        triton_ops.norm_rotary_write_kv(x[:-1], eps, *split(x @ w_qkv.T), rotary)
    with pytest.raises(ValueError, match="h must be contiguous"):
        triton_ops.norm_silu_and_mul(x.T.contiguous().T, eps, x @ w_gate_up.T)


def paged_case(g, lens, heads, kv_heads, d, page, extra_blocks=8):
    """Random caches, block tables (shuffled blocks) and queries for sequences of `lens`."""
    width = max(-(-n // page) for n in lens)
    blocks = len(lens) * width + extra_blocks
    kc = torch.randn(blocks + 1, page, kv_heads, d, dtype=DTYPE, device=DEVICE, generator=g)
    vc = torch.randn_like(kc)
    perm = torch.randperm(blocks, device=DEVICE, generator=g)
    tables = perm[: len(lens) * width].view(len(lens), width).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), heads, d, dtype=DTYPE, device=DEVICE, generator=g)
    return q, kc, vc, tables, seq_lens


# GQA 1 and 4 (and 4 of 32 heads on the GPU); the interpreter runs every program in turn.
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 2), (32, 8)] if CUDA else [(2, 2), (8, 2)])
@pytest.mark.parametrize("page", [16, 4])
def test_decode_attention_matches_reference(heads, kv_heads, page):
    g = torch.Generator(device=DEVICE).manual_seed(heads * 100 + page)
    d = 64 if not CUDA else 128
    lens = [1, 2, page, page + 1, 63, 64, 65, 300, 777] if CUDA else [1, page + 1, 65, 130]
    q, kc, vc, tables, seq_lens = paged_case(g, lens, heads, kv_heads, d, page)
    ref = ref_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
    # The default plan (several splits merged by the last one to finish), then one split.
    out = triton_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
    assert triton_attention.decode_plan(len(lens), kv_heads, tables.shape[1] * page).splits > 1
    assert rel(out, ref) < (1e-2 if CUDA else 1e-5)
    # One split writing the output itself; many short splits, most of them empty.
    for plan in (
        triton_attention.DecodePlan(splits=1, tile=32, num_warps=4, num_stages=2),
        triton_attention.DecodePlan(splits=8, tile=16, num_warps=4, num_stages=3),
    ):
        got = triton_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5, plan=plan)
        assert rel(got, ref) < (1e-2 if CUDA else 1e-5), plan
    # A second call gives the same result: the merge left every split counter at zero.
    assert torch.equal(triton_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5), out)
    # Each sequence alone (batch 1: the most splits, the merge of the whole group) gives
    # its row of the batch.
    for i in range(len(lens)):
        one = triton_attention.decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], seq_lens[i:i + 1], d**-0.5)
        assert rel(one[0], ref[i]) < (1e-2 if CUDA else 1e-5), lens[i]
    # Zero-length rows (bucket padding) give zeros, never NaN.
    seq_lens[0] = 0
    out = triton_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
    assert not out.isnan().any() and out[0].abs().sum() == 0


def test_decode_plan_knobs():
    """The batch-1 program target reaches the plans made after it is set, and only batch 1's."""
    one = triton_attention.decode_plan(1, 32, 512)
    assert (one.splits, one.tile, one.num_warps) == (32, 16, 1)
    batch8 = triton_attention.decode_plan(8, 32, 512)
    saved = triton_attention.BATCH1_PROGRAMS
    try:
        triton_attention.BATCH1_PROGRAMS = 128
        assert triton_attention.decode_plan(1, 32, 512).splits == 4
        assert triton_attention.decode_plan(8, 32, 512).splits == batch8.splits == 2
    finally:
        triton_attention.BATCH1_PROGRAMS = saved


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_prefill_attention_matches_reference_with_padding(heads, kv_heads):
    """Whole prompts, a later chunk and decode rows in one step, over the paged cache,
    with bucket padding: every row, the padding rows too, follows the reference."""
    g = torch.Generator(device=DEVICE).manual_seed(heads)
    d = 64
    spans = [(0, 1), (0, 70), (41, 5), (130, 1), (7, 33)]
    step, q, kc, vc, _ = paged_step(g, DEVICE, DTYPE, spans, heads, kv_heads, d, pad=11, padded_seqs=2)
    ref = ref_attention.prefill_attention(q, kc, vc, step, d**-0.5)
    plans = [None, triton_attention.PrefillPlan(block_m=16, block_n=16, num_warps=2, num_stages=1)]
    if CUDA:  # every plan a bucket can pick, split or not, on one step (the interpreter would take minutes)
        sms = triton_attention.multiprocessors(q.device)
        plans += sorted({triton_attention.prefill_plan(t, *shape, sms=sms) for t in (16, 32, 64, 128, 4096)
                         for shape in ((), (heads, 4096, 8))}, key=repr)
    for plan in plans:
        out = triton_attention.prefill_attention(q, kc, vc, step, d**-0.5, plan=plan)
        assert not out.isnan().any()
        assert rel(out, ref) < (2e-2 if CUDA else 1e-5), plan


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_prefill_attention_reads_the_steps_own_keys_from_the_step(heads, kv_heads):
    """Given the step's k and v (strided, as the fused projection leaves them), the
    kernel reads each sequence's keys from its first row in the step on from them, and
    the earlier ones through the block table: with the cache's copies of the step's keys
    made NaN the output still follows the reference (whole prompts, a later chunk,
    decode rows, padding; one and several key splits)."""
    g = torch.Generator(device=DEVICE).manual_seed(heads + 7)
    d = 64
    spans = [(0, 1), (0, 70), (41, 5), (130, 1), (7, 33)]
    step, q, kc, vc, contexts = paged_step(g, DEVICE, DTYPE, spans, heads, kv_heads, d, pad=11, padded_seqs=2)
    ref = ref_attention.prefill_attention(q, kc, vc, step, d**-0.5)
    k, v = step_kv(spans, contexts, 11, heads)
    poisoned = poison_step_slots(step, kc, vc, spans)
    plans = [None, triton_attention.PrefillPlan(block_m=16, block_n=16, num_warps=2, num_stages=1),
             triton_attention.PrefillPlan(block_m=16, block_n=32, num_warps=4, num_stages=2, splits=3, min_split=32)]
    for plan in plans:
        out = triton_attention.prefill_attention(q, *poisoned, step, d**-0.5, plan=plan, k=k, v=v)
        assert not out.isnan().any(), plan
        assert rel(out, ref) < (2e-2 if CUDA else 1e-5), plan
    # Without the step's keys, the poisoned copies are read: the test would see a kernel that ignores k, v.
    assert triton_attention.prefill_attention(q, *poisoned, step, d**-0.5).isnan().any()


def test_prefill_attention_refuses_step_keys_of_another_shape():
    """The step's k and v must be [T, kv_heads, head_dim], contiguous in head_dim: any
    other layout is refused, naming the shapes, before a kernel would read past them."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    spans = [(0, 20)]
    step, q, kc, vc, contexts = paged_step(g, DEVICE, DTYPE, spans, 4, 2, 32)
    k, v = step_kv(spans, contexts, 0, 4)
    for bad_k, bad_v in ((k[:10], v[:10]), (k[:, :1], v[:, :1]), (k, v[:, :, :16]),
                         (k.transpose(1, 2).contiguous().transpose(1, 2), v)):
        with pytest.raises(ValueError, match=r"the step's keys and values must be \[T, kv_heads, head_dim\]"):
            triton_attention.prefill_attention(q, kc, vc, step, 32**-0.5, k=bad_k, v=bad_v)


def sdpa_causal(q, spans, contexts, scale):
    """float32 scaled-dot-product attention of each sequence's rows over its contiguous
    context, the causal mask offset by the context cached before its first row; padding
    rows are 0."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    row = 0
    for (start, rows), (keys, values) in zip(spans, contexts, strict=True):
        visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= torch.arange(start, start + rows,
                                                                                          device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q[row:row + rows].float().transpose(0, 1), keys.float().transpose(0, 1),
                                           values.float().transpose(0, 1), attn_mask=visible, scale=scale,
                                           enable_gqa=True)
        out[row:row + rows] = o.transpose(0, 1)
        row += rows
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(2, 1, 32), (2, 2, 64)])
def test_split_prefill_attention_matches_sdpa(heads, kv_heads, d):
    """The keys split over several programs and merged: a query tail after a long cached
    prefix, a whole prompt, a decode row and a short chunk in one step, contexts off the
    block boundaries, with bucket padding. Three splits (runs of 64 keys and more, the
    short sequences in one run written directly), then twelve (runs of 32 keys: the tail's
    ten runs merge, the other splits exit); a repeat gives the same bits (the merges left
    every ticket at zero)."""
    g = torch.Generator(device=DEVICE).manual_seed(heads + d)
    spans = [(293, 24), (0, 37), (130, 1), (45, 3)]
    step, q, kc, vc, contexts = paged_step(g, DEVICE, DTYPE, spans, heads, kv_heads, d, pad=3, padded_seqs=1)
    ref = sdpa_causal(q, spans, contexts, d**-0.5)
    plan = triton_attention.PrefillPlan(block_m=16, block_n=32, num_warps=4, num_stages=2, splits=3, min_split=64)
    for plan in (plan, dataclasses.replace(plan, splits=12, min_split=32)):
        out = triton_attention.prefill_attention(q, kc, vc, step, d**-0.5, plan=plan)
        assert rel(out, ref) < (2e-2 if CUDA else 1e-5), plan
        assert not out[-3:].any()  # padding rows
    assert torch.equal(triton_attention.prefill_attention(q, kc, vc, step, d**-0.5, plan=plan), out)


def test_prefill_plan_splits_few_query_tiles_over_long_contexts():
    """On an H100's 132 multiprocessors, a prefill graph's buckets (8 sequences) at 32
    heads and max_model_len 4096: a 64-token tail and a 256-token chunk split their keys, a
    2048-token step fills the GPU without; no split grid passes SPLIT_GRID_PER_SM programs
    a multiprocessor, and contexts within one run (max_model_len 256) never split."""
    def plan(tokens, max_context=4096):
        return triton_attention.prefill_plan(tokens, heads=32, max_context=max_context, seqs=8, sms=132)

    assert plan(64).splits > 1 and plan(256).splits > 1
    assert plan(2048).splits == 1
    assert plan(64, max_context=256).splits == plan(256, max_context=256).splits == 1
    for tokens in (16, 32, 64, 128, 256, 512, 1024, 2048):
        p = plan(tokens)
        grid = (-(-tokens // p.block_m) + 8 + 1) * 32 * p.splits
        assert p.splits == 1 or grid <= triton_attention.SPLIT_GRID_PER_SM * 132, (tokens, p)
        assert p.min_split % p.block_n == 0 and p.min_split >= triton_attention.MIN_SPLIT_KEYS
        assert dataclasses.replace(p, splits=1, min_split=256) == triton_attention.prefill_plan(tokens)


@torch.inference_mode()
def test_model_through_the_triton_kernels_matches_the_torch_path(tiny_model_dir):
    """The whole forward (fused RoPE + KV write, prefill and decode attention reading what
    it wrote) through the Triton kernels against the torch path, on each architecture."""
    from hybridd.model import KVCache, load_model
    from hybridd.kernels.selection import select_kernels

    model = load_model(tiny_model_dir, dtype=DTYPE, device=DEVICE)
    prompts = [[5, 9, 3, 17, 2, 8, 11], [4, 30, 99] * 7, [7]]
    tables = [[0, 1, 2], [3, 4, 5, 6, 7, 8], [9]]
    decode_tokens = [[1, 2, 3], [40, 41, 42], [100, 101, 102]]
    logits = {}
    for kernels in ("torch", "triton"):
        model.kernels = select_kernels(DEVICE, kernels)
        kv = KVCache.allocate(model.config, 10, 4, DTYPE, DEVICE)
        out = [model.forward_logits(StepInputs.prefill(prompts, tables, 4, DEVICE), kv)]
        for i in range(3):
            positions = [len(p) + i for p in prompts]
            step = StepInputs.decode([t[i] for t in decode_tokens], positions, tables, 4, DEVICE)
            out.append(model.forward_logits(step, kv))
        logits[kernels] = torch.cat(out)
    assert rel(logits["triton"], logits["torch"]) < (2e-2 if CUDA else 1e-4)


PROMPTS = [[5, 9, 3, 17, 2, 8, 11], [4, 30, 99] * 7, [7]]  # a 29-token prefill


def _steps_logits(model, kv_factory, device, prompts=PROMPTS):
    """Logits of a packed prefill of three prompts, then three decode steps of all three
    (blocks of 4 slots, numbered in order; the cache needs 16 blocks at the most)."""
    sizes = [-(-(len(p) + 3) // 4) for p in prompts]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    tables = [list(range(start, start + size)) for start, size in zip(starts, sizes)]
    decode_tokens = [[1, 2, 3], [40, 41, 42], [100, 101, 102]]
    kv = kv_factory()
    out = [model.forward_logits(StepInputs.prefill(prompts, tables, 4, device), kv)]
    for i in range(3):
        positions = [len(p) + i for p in prompts]
        step = StepInputs.decode([t[i] for t in decode_tokens], positions, tables, 4, device)
        out.append(model.forward_logits(step, kv))
    return torch.cat(out), kv


def _fused_against_torch(tiny_model_dir, enabled, monkeypatch, shapes, prompts=PROMPTS):
    """The tiny model (random norm weights, folded when `norm` is enabled) through the
    Triton kernels with the skinny kernel for the projections `shapes` names (o_proj split
    in K) and `enabled` fused, against the torch path on the same weights: logits and KV
    caches. Returns the kinds of fused launches made."""
    from hybridd.kernels import gemm_fusions
    from hybridd.kernels import triton_gemm
    from hybridd.kernels.choices import KernelChoices
    from hybridd.model import KVCache, load_model
    from hybridd.kernels.selection import select_kernels
    from hybridd.kernels.triton_gemm import GemmConfig

    model = load_model(tiny_model_dir, dtype=DTYPE, device=DEVICE)
    g = torch.Generator().manual_seed(3)
    for layer in model.layers:  # a checkpoint's norms are all ones: the fusions must apply them
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
    if "norm" in enabled:
        model.fold_norms()  # on the model both paths then run: the torch path is the reference
    layer = model.layers[0]
    table = {tuple(getattr(layer, name).weight.shape): [(32, GemmConfig(16, 32, 2 if name == "o_proj" else 1))]
             for name in shapes}
    # Configs that fit the tiny model's shapes, for the projections named only.
    monkeypatch.setattr(triton_gemm, "config_for",
                        lambda m, n, k, multiprocessors, weight_bytes=2, shared_bytes=None: table.get((n, k), [(0, None)])[0][1] if m <= 32 else None)
    launched = []
    real_launch = triton_gemm.launch

    def counting_launch(*args, **kwargs):
        launched.append([k for k in ("rotary", "norm", "residual") if kwargs.get(k) is not None])
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(triton_gemm, "launch", counting_launch)

    def kv_factory():
        return KVCache.allocate(model.config, 16, 4, DTYPE, DEVICE)

    model.kernels = select_kernels(DEVICE, "torch")
    ref_logits, ref_kv = _steps_logits(model, kv_factory, DEVICE, prompts)
    model.kernels = select_kernels(DEVICE, KernelChoices("triton", gemm_fusions.parse(enabled)))
    model.kernels.norms_folded = "norm" in enabled
    logits, kv = _steps_logits(model, kv_factory, DEVICE, prompts)
    assert rel(logits, ref_logits) < (2e-2 if CUDA else 1e-5)
    for i in range(model.config.num_layers):
        for got, want in zip(kv.layer(i), ref_kv.layer(i)):
            assert rel(got, want) < (2e-2 if CUDA else 1e-5)
    return [k for call in launched for k in call], model.config.num_layers


@torch.inference_mode()
def test_folding_the_norms_keeps_the_function(tiny_model_dir):
    """`fold_norms` moves each norm's weight into the projection after it: the same logits
    (up to rounding) from the same steps, the norms' weights ones, the final norm kept."""
    from hybridd.model import KVCache, load_model

    model = load_model(tiny_model_dir, dtype=DTYPE, device=DEVICE, kernels="torch")
    g = torch.Generator().manual_seed(5)
    for layer in model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
    model.norm.weight.copy_(0.5 + torch.rand(model.norm.weight.shape, generator=g))
    final = model.norm.weight.clone()

    def kv_factory():
        return KVCache.allocate(model.config, 16, 4, DTYPE, DEVICE)

    before, _ = _steps_logits(model, kv_factory, DEVICE)
    model.fold_norms()
    after, _ = _steps_logits(model, kv_factory, DEVICE)
    assert rel(after, before) < (2e-2 if CUDA else 1e-5)
    assert all(bool((n.weight == 1).all()) for layer in model.layers
               for n in (layer.input_layernorm, layer.post_attention_layernorm))
    assert torch.equal(model.norm.weight, final)


def _skip_qk_norm(model_dir) -> None:
    """The fused-neighbour counts below are those of a qkv projection that takes the
    norm and RoPE; a q/k-norm model (Qwen3) runs its head norm and RoPE in their own
    kernel after the projection (its Triton path is checked against the torch path in
    tests/test_model_qwen3_yarn.py)."""
    from hybridd.model import ModelConfig

    if ModelConfig.from_dir(model_dir).qk_norm:
        pytest.skip("q/k-norm model: its qkv projection fuses no neighbour")


@torch.inference_mode()
@pytest.mark.parametrize("enabled", ["norm", "rotary", "norm,rotary"])
def test_fused_neighbours_match_the_torch_path(tiny_model_dir, enabled, monkeypatch):
    """Every projection of the tiny model on the skinny kernel (a config for each of its
    shapes, the o_proj's split in K), with the named neighbours fused into it: the
    logits of a 29-token prefill and three decode steps, and the KV caches they wrote,
    equal the torch path's (float32 on the CPU; bf16 within a rounding step on the GPU).
    The fused launches are counted, so a fallback to the separate kernels cannot pass."""
    _skip_qk_norm(tiny_model_dir)
    kinds, layers = _fused_against_torch(tiny_model_dir, enabled, monkeypatch,
                                         ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    steps = 4
    expected = {"norm": 2 * layers * steps - steps, "residual": 2 * layers * steps, "rotary": layers * steps}
    for name in enabled.split(","):
        for kind in {"norm": ("norm", "residual"), "rotary": ("rotary",)}[name]:
            assert kinds.count(kind) == expected[kind], (kind, kinds.count(kind))


@torch.inference_mode()
def test_fused_steps_fall_back_where_the_kernel_cannot_run(tiny_model_dir, monkeypatch):
    """Every fusion on and the norms folded, but gate/up without a skinny config and a
    40-token prefill (more rows than the kernel takes): the steps that cannot fuse run
    the separate kernels on the folded weights (unit-weight norms, the add where the
    stream still carries it), and the logits and caches still equal the torch path's."""
    _skip_qk_norm(tiny_model_dir)
    prompts = [[5, 9, 3, 17, 2, 8, 11], [4, 30, 99] * 10, [7, 8]]
    kinds, layers = _fused_against_torch(tiny_model_dir, "norm,rotary", monkeypatch,
                                         ("qkv_proj", "o_proj", "down_proj"), prompts)
    decode_steps = 3
    assert kinds.count("residual") == 2 * layers * decode_steps  # o and down of each decode step
    assert kinds.count("norm") == (layers - 1) * decode_steps  # qkv after down's fused add; gate/up falls back
    assert kinds.count("rotary") == layers * decode_steps


@torch.inference_mode()
def test_a_prefill_past_the_skinny_rows_runs_no_norm_kernel(tiny_model_dir, monkeypatch):
    """Norms folded and a 40-token prefill (more rows than the skinny kernel takes, so
    every projection runs on cuBLAS): cuBLAS adds o's and down's products to the stream,
    RoPE and SiLU·mul apply the norms' row scales, and only the final norm is a kernel of
    its own; logits and caches still equal the torch path's. The three decode steps after
    it (skinny projections) normalise the embedding and the last stream as before. A qkv
    projection with a bias (Qwen2) cannot be scaled after it: its norm stays a kernel."""
    _skip_qk_norm(tiny_model_dir)
    from hybridd.kernels import triton_ops as ops_module
    from hybridd.model.config import ModelConfig

    qkv_bias = ModelConfig.from_dir(tiny_model_dir).qkv_bias

    calls = {"rms_norm": 0, "add_rms_norm": 0, "norm_rotary_write_kv": 0, "norm_silu_and_mul": 0}
    for name in calls:
        real = getattr(ops_module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops_module, name, counted)
    prompts = [[5, 9, 3, 17, 2, 8, 11], [4, 30, 99] * 10, [7, 8]]
    _, layers = _fused_against_torch(tiny_model_dir, "norm,rotary", monkeypatch,
                                     ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), prompts)
    decode_steps = 3
    assert calls["add_rms_norm"] == 0
    # The prefill's final norm (and each qkv's norm where it has a bias); each decode step's first and last.
    assert calls["rms_norm"] == 1 + qkv_bias * layers + 2 * decode_steps
    assert calls["norm_rotary_write_kv"] == (not qkv_bias) * layers and calls["norm_silu_and_mul"] == layers


# The shapes of the supported models on the GPU: Llama-2-7B (32 heads, 32 kv heads, d 128),
# Llama-3-8B (32 / 8, d 128), and odd ones (d 64, GQA 8), over both block sizes.
MODEL_SHAPES = [(32, 32, 128), (32, 8, 128), (16, 2, 64), (8, 8, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv_heads", "d"), MODEL_SHAPES)
@pytest.mark.parametrize("page", [16, 32])
def test_decode_attention_model_shapes(heads, kv_heads, d, page):
    g = torch.Generator(device=DEVICE).manual_seed(heads * kv_heads + d + page)
    for batch in (1, 3, 8, 32):
        # Lengths on, just before and just after block boundaries, up to 4 K tokens.
        edges = torch.tensor([1, page - 1, page, page + 1, 4 * page + 1, 511, 512, 513, 4095, 4097])
        lens = edges[torch.randint(0, len(edges), (batch,), generator=torch.Generator().manual_seed(batch))].tolist()
        q, kc, vc, tables, seq_lens = paged_case(g, lens, heads, kv_heads, d, page)
        ref = ref_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
        out = triton_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
        assert rel(out, ref) < 1e-2, (batch, lens)


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv_heads", "d"), MODEL_SHAPES[:3])
def test_decode_attention_graph_replays_new_lengths(heads, kv_heads, d):
    """One capture serves every length and block table written into its inputs."""
    g = torch.Generator(device=DEVICE).manual_seed(7)
    page, batch = 16, 4
    q, kc, vc, tables, seq_lens = paged_case(g, [4096] * batch, heads, kv_heads, d, page)
    triton_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
    for lens in ([1, 17, 300, 4096], [4000, 2, 33, 1000], [5, 5, 5, 5]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        tables.copy_(tables[torch.randperm(batch, generator=torch.Generator().manual_seed(lens[0]))])
        q.copy_(torch.randn(q.shape, dtype=q.dtype, device=DEVICE, generator=g))
        graph.replay()
        ref = ref_attention.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
        assert rel(out, ref) < 1e-2, lens


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv_heads", "d"), MODEL_SHAPES)
def test_prefill_attention_model_shapes(heads, kv_heads, d):
    g = torch.Generator(device=DEVICE).manual_seed(heads + kv_heads + d)
    cases = [([(0, 16)], 0, 0), ([(0, 3), (0, 9)], 4, 2), ([(0, 100), (57, 1), (300, 27)], 0, 1),
             ([(512, 200), (0, 311)], 1, 3), ([(0, 1000), (1000, 1000)] + [(900 + i, 1) for i in range(30)], 11, 0)]
    for spans, pad, padded_seqs in cases:
        step, q, kc, vc, contexts = paged_step(g, DEVICE, DTYPE, spans, heads, kv_heads, d, pad=pad,
                                               padded_seqs=padded_seqs)
        out = triton_attention.prefill_attention(q, kc, vc, step, d**-0.5)
        assert not out.isnan().any()
        assert rel(out, dense_causal(q, spans, contexts, d**-0.5)) < 2e-2, spans


@pytest.mark.gpu
def test_prefill_attention_at_a_long_context():
    """A 16 K-token prompt's last 2 K-token chunk over its paged context (a max_model_len
    prompt): no T×T buffer in the kernel; checked against dense causal attention."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    heads, kv_heads, d = 32, 8, 128
    spans = [(14336, 2048)]
    step, q, kc, vc, contexts = paged_step(g, DEVICE, DTYPE, spans, heads, kv_heads, d)
    out = triton_attention.prefill_attention(q, kc, vc, step, d**-0.5)
    assert not out.isnan().any()
    assert rel(out, dense_causal(q, spans, contexts, d**-0.5)) < 2e-2



@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv_heads", "d"), MODEL_SHAPES[:2])
def test_split_prefill_attention_graph_replays_new_contexts(heads, kv_heads, d):
    """A 64-token prefill graph's bucket (8 sequences, tables for 4096 tokens), captured
    once with its split plan, serves every context written into its inputs: a tail after
    a long cached prefix, prompts beside a decode row, a tail ending at the table's last
    position, a cold prompt."""
    g = torch.Generator(device=DEVICE).manual_seed(11)
    tokens, seqs, width, page = 64, 8, 256, 16
    kc = torch.randn(seqs * width + 1, page, kv_heads, d, dtype=DTYPE, device=DEVICE, generator=g)
    vc = torch.randn_like(kc)

    def case(spans):
        return paged_step(g, DEVICE, DTYPE, spans, heads, kv_heads, d, page, pad=tokens - sum(r for _, r in spans),
                          padded_seqs=seqs - len(spans), table_width=width, caches=(kc, vc))

    step, q, _, _, _ = case([(0, tokens)])
    sms = triton_attention.multiprocessors(q.device)
    assert triton_attention.prefill_plan(tokens, heads, width * page, seqs, sms).splits > 1
    triton_attention.prefill_attention(q, kc, vc, step, d**-0.5)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_attention.prefill_attention(q, kc, vc, step, d**-0.5)
    for spans in ([(1936, 64)], [(0, 16), (500, 40), (3000, 1), (17, 7)], [(4032, 64)], [(0, 64)]):
        new, new_q, _, _, contexts = case(spans)
        for name in ("positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
            getattr(step, name).copy_(getattr(new, name))
        q.copy_(new_q)
        graph.replay()
        assert rel(out, dense_causal(q, spans, contexts, d**-0.5)) < 2e-2, spans


def graph_us_per_call(call, calls: int = 32, rounds: int = 20) -> float:
    """Median µs per call of call(i) for i < `calls`, captured back to back in one graph."""
    call(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


# (step, spans, bucket): the prefix-cache tail and the chunks beside a stream of the
# bench's prefix_reuse and mixed_load parts, a short cold prompt, and a cold bucket the
# rule splits in two.
SPLIT_TIMING_CASES = (
    ("64 after 1936 cached", [(1936, 64)], 64),
    ("256 at context 256", [(256, 256)], 256),
    ("256 at context 1024", [(1024, 256)], 256),
    ("256 at context 1792", [(1792, 256)], 256),
    ("16 at context 0", [(0, 16)], 16),
    ("1024 at context 0", [(0, 1024)], 1024),
)


@pytest.mark.gpu
def test_split_prefill_attention_timings(capsys):
    """Prints µs per prefill attention call of each split count at the Llama-2-7B (32
    heads, 32 KV heads) and Llama-3-8B (32 / 8) shapes, d 128, in a prefill graph's
    bucket (8 sequences, tables for 4096 tokens), each call in a graph of 32 reading its
    own copy of the cache (as each layer does: not from L2), under the daemon's launch
    settings for the step (dependent launch up to 32 rows). Columns: `old` (with
    OLD_TRITON_ATTENTION naming a copy of the module before splits), 1 split, the
    plan's rule and 2-16 splits; each output is checked against dense attention.

        git show 0bdc8f1:hybridd/kernels/triton_attention.py > /tmp/old_attention.py
        OLD_TRITON_ATTENTION=/tmp/old_attention.py python -m pytest -q -m gpu \\
            -k split_prefill_attention_timings tests/test_gpu_kernels.py
    """
    from hybridd.kernels.selection import TritonKernels

    old = None
    if os.environ.get("OLD_TRITON_ATTENTION"):
        spec = importlib.util.spec_from_file_location("old_triton_attention", os.environ["OLD_TRITON_ATTENTION"])
        old = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(old)
    d, page, width, seqs, copies = 128, 16, 256, 8, 8
    sms = triton_attention.multiprocessors(torch.device(DEVICE))
    split_counts = (2, 4, 8, 16)
    lines = [f"prefill attention, µs per call ({torch.cuda.get_device_name()}, {sms} SMs); columns: split counts",
             f"{'shape':10s} {'step':22s} {'old':>7s} {'1':>7s} {'rule':>12s} "
             + " ".join(f"{s:>7d}" for s in split_counts)]
    for shape, (heads, kv_heads) in {"llama2-7b": (32, 32), "llama3-8b": (32, 8)}.items():
        for what, spans, bucket in SPLIT_TIMING_CASES:
            g = torch.Generator(device=DEVICE).manual_seed(bucket)
            step, q, kc, vc, contexts = paged_step(g, DEVICE, DTYPE, spans, heads, kv_heads, d, page,
                                                   pad=bucket - sum(r for _, r in spans),
                                                   padded_seqs=seqs - len(spans), table_width=width)
            caches = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(copies - 1)]
            ref = dense_causal(q, spans, contexts, d**-0.5)
            rule = triton_attention.prefill_plan(bucket, heads, width * page, seqs, sms)
            plans = [dataclasses.replace(rule, splits=1), rule] + [dataclasses.replace(rule, splits=s)
                                                                   for s in split_counts]
            times = []
            with TritonKernels().launches(bucket):
                if old is not None:
                    assert rel(old.prefill_attention(q, kc, vc, step, d**-0.5), ref) < 2e-2
                    times.append(graph_us_per_call(lambda i: old.prefill_attention(q, *caches[i % copies], step,
                                                                                   d**-0.5)))
                for plan in plans:
                    assert rel(triton_attention.prefill_attention(q, kc, vc, step, d**-0.5, plan=plan), ref) < 2e-2
                    times.append(graph_us_per_call(
                        lambda i, plan=plan: triton_attention.prefill_attention(q, *caches[i % copies], step, d**-0.5,
                                                                                plan=plan)))
            cells = ([f"{times.pop(0):7.1f}"] if old is not None else [f"{'-':>7s}"]) + [f"{times[0]:7.1f}",
                     f"{times[1]:7.1f} ({rule.splits:2d})"] + [f"{t:7.1f}" for t in times[2:]]
            lines.append(f"{shape:10s} {what:22s} " + " ".join(cells))
    with capsys.disabled():
        print("\n" + "\n".join(lines))

# Two layers of each supported shape: every projection then runs through the skinny
# GEMM's table (the shapes it has configs for), so its weight prefetch is exercised.
PDL_SHAPES = {
    "llama2-7b": {"intermediate_size": 11008, "num_key_value_heads": 32, "vocab_size": 32000},
    "llama3-8b": {"intermediate_size": 14336, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0},
}


def two_layer_model(shape: str):
    """(config, model): two layers of `shape` (PDL_SHAPES) on the Triton kernels with
    random bf16 weights; skips where programmatic dependent launch is not supported."""
    from hybridd.kernels import pdl
    from hybridd.model.config import ModelConfig
    from hybridd.model.llama import LlamaModel

    if not pdl.supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9+")
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 2,
        "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16", **PDL_SHAPES[shape],
    })
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaModel(cfg, "cuda", max_positions=2048, kernels="triton").to(torch.bfloat16)
    return cfg, model


def replayed_logits(model, step, kv, before_replay=lambda: None) -> torch.Tensor:
    """The step's logits from a CUDA graph of it, captured after one eager call (which
    compiles the kernels of the settings in force) and replayed three times, each after
    `before_replay`."""
    with torch.no_grad():
        model.forward_logits(step, kv)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model.forward_logits(step, kv)
    for _ in range(3):
        before_replay()
        graph.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("shape", sorted(PDL_SHAPES))
def test_dependent_launch_changes_no_bit_of_a_decode_step(shape):
    """A decode step captured as a graph with programmatic dependent launch gives the
    logits of the same step without it, bit for bit: a kernel that touched step data
    before its predecessor finished would not."""
    from hybridd.kernels import triton_gemm
    from hybridd.kernels.choices import KernelChoices
    from hybridd.kernels.selection import select_kernels
    from hybridd.model import KVCache

    cfg, model = two_layer_model(shape)
    page, lens = 16, [700, 33, 1]
    kv = KVCache.allocate(cfg, 3 * 45 + 1, page, torch.bfloat16, "cuda")
    tables = [list(range(i * 45, i * 45 + 45)) for i in range(len(lens))]
    step = StepInputs.decode([7, 8, 9], lens, tables, page).to("cuda")
    assert all(triton_gemm.config_of(3, w) is not None
               for w in (model.layers[0].qkv_proj.weight, model.layers[0].o_proj.weight,
                         model.layers[0].gate_up_proj.weight, model.layers[0].down_proj.weight, model.lm_head.weight))
    logits = {}
    for on in (False, True):
        model.kernels = select_kernels("cuda", KernelChoices("triton", frozenset(), pdl=on))
        logits[on] = replayed_logits(model, step, kv)
    assert torch.equal(logits[True], logits[False])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fusions", ["norm", "norm,rotary"])
@pytest.mark.parametrize("shape", sorted(PDL_SHAPES))
def test_batch_one_attention_reads_the_newest_token_after_its_wait(shape, fusions):
    """The kernel before decode attention (RoPE and the KV write, or the qkv projection
    with them in its epilogue: a long weight read ending in the write) stores the newest
    token's key and value; under programmatic dependent launch the attention starts while
    that kernel runs and must read them only after its wait. The newest token's slot is
    filled with large values before every replay, so a read before the write would change
    the logits, which must equal those of the same graph without dependent launch bit for
    bit, for newest tokens in the first, a middle and the last of the batch-1 splits."""
    from hybridd.kernels import gemm_fusions
    from hybridd.kernels.choices import KernelChoices
    from hybridd.kernels.selection import select_kernels
    from hybridd.model import KVCache

    cfg, model = two_layer_model(shape)
    page, width = 16, 64
    kv = KVCache.allocate(cfg, width + 1, page, torch.bfloat16, "cuda")
    kv.arena.normal_()
    table = torch.randperm(width).tolist()
    kernels = {on: select_kernels("cuda", KernelChoices("triton", gemm_fusions.parse(fusions), pdl=on))
               for on in (False, True)}
    for chosen in kernels.values():
        chosen.norms_folded = "norm" in chosen.fusions
    for position in (36, 300, 1000):
        step = StepInputs.decode([7], [position], [table], page).to("cuda")
        block, offset = table[position // page], position % page

        def poison(block=block, offset=offset):
            kv.arena[:, :, block, offset] = 30.0

        logits = {}
        for on in (False, True):
            model.kernels = kernels[on]
            logits[on] = replayed_logits(model, step, kv, before_replay=poison)
        assert torch.equal(logits[True], logits[False]), position
