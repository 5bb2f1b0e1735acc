"""FP8 weights on the Triton kernels (hybridd/kernels/triton_gemm.py, triton_fp8.py)
against the emulated numerics (`hybridd.kernels.fp8.linear`, float32 over the
dequantized weight): on the CPU through Triton's interpreter in float32 on small odd
shapes, the tiny model through the Triton kernel set against the torch kernel set; on
the GPU in bf16 for every projection of Llama-2-7B and Llama-3-8B (tests marked `gpu`)."""

from __future__ import annotations

import pytest
import torch

from hybridd.kernels import fp8
from hybridd.kernels import ops as ref_ops
from tests.triton_target import CUDA, DEVICE, DTYPE, rel, require_triton

require_triton()

from hybridd.kernels import triton_fp8, triton_gemm, triton_quantize  # noqa: E402
from hybridd.kernels.choices import KernelChoices  # noqa: E402
from hybridd.kernels.triton_gemm import FoldedNorm, GemmConfig  # noqa: E402

# Float32 on the CPU: the same sums in another order. bf16 on the GPU: one rounding of the
# output, and of the normalised activations where the kernel normalises them.
TOL = 1e-2 if CUDA else 1e-5
# The float16 decode forms round float32 activations to float16 (11 bits) on the CPU.
F16_TOL = 1e-2 if CUDA else 2e-3

LLAMA2_7B = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def fp8_operands(m: int, n: int, k: int, bias: bool, seed: int, activations: str = "none"):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, dtype=DTYPE, device=DEVICE, generator=g)
    w = torch.randn(n, k, dtype=torch.float32, device=DEVICE, generator=g) * 0.05
    b = torch.randn(n, dtype=DTYPE, device=DEVICE, generator=g) if bias else None
    input_scale = None
    if activations == "static":  # one calibrated scale per fused part; the largest applies
        input_scale = torch.tensor([0.9, 1.3, 1.1], device=DEVICE) * x.float().abs().max() / fp8.FP8_MAX
    return x, fp8.Fp8Weight(*fp8.quantize_rows(w), activations, input_scale), b


@pytest.mark.parametrize(
    ("m", "n", "k", "split", "bias", "activations"),
    [
        (1, 48, 96, 1, False, "none"),     # one row
        (5, 50, 200, 3, True, "none"),     # N, K not multiples of the tiles, uneven split, bias
        (17, 33, 130, 2, False, "none"),   # BLOCK_M 32, a split running past K
        (32, 64, 256, 4, True, "none"),    # the most rows, even split
        (3, 40, 100, 1, True, "dynamic"),  # activations per token (an FP8 checkpoint)
        (9, 24, 72, 2, False, "static"),   # activations with static scales, split
    ],
)
def test_skinny_fp8_equals_the_emulated_product(m, n, k, split, bias, activations):
    x, w, b = fp8_operands(m, n, k, bias, seed=m * 1000 + n + k, activations=activations)
    out = triton_gemm.launch(x, w, b, GemmConfig(block_n=16, block_k=32, split_k=split))
    assert out is not None and out.shape == (m, n) and out.dtype == DTYPE
    assert rel(out, fp8.linear(x, w, b)) < TOL


@pytest.mark.parametrize(("m", "k", "parts", "split"), [(1, 96, 6, 1), (5, 200, 13, 3), (17, 130, 1, 2)])
def test_fp8_projection_applies_the_norm_to_its_activations(m, k, parts, split):
    """The norm's weight cannot be folded into an FP8 weight: with `FoldedNorm.weight` the
    kernel normalises each activation tile as it loads it, from the row's sums of squares
    in parts, and multiplies by the norm's weight: rms_norm(x, g) @ W.T as the separate
    norm would feed the product."""
    x, w, _ = fp8_operands(m, 48, k, False, seed=m + k)
    g = 0.5 + torch.rand(k, generator=torch.Generator(device=DEVICE).manual_seed(k), device=DEVICE).to(DTYPE)
    squares = x.float().pow(2)
    cuts = torch.linspace(0, k, parts + 1).long()
    sums = torch.stack([squares[:, a:c].sum(1) for a, c in zip(cuts[:-1], cuts[1:])], dim=1).contiguous()
    out = triton_gemm.launch(x, w, None, GemmConfig(16, 32, split), norm=FoldedNorm(1e-5, sums, g))
    assert rel(out, fp8.linear(ref_ops.rms_norm(x, g, 1e-5), w)) < TOL


@pytest.mark.parametrize(("m", "n", "k", "split"), [(1, 48, 96, 1), (5, 50, 200, 3), (32, 40, 64, 1)])
def test_fp8_residual_epilogue_adds_to_the_stream(m, n, k, split):
    x, w, b = fp8_operands(m, n, k, True, seed=m * 7 + n)
    residual = torch.randn(m, n, dtype=DTYPE, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(m))
    summed, parts = triton_gemm.launch(x, w, b, GemmConfig(16, 32, split), residual=residual)
    assert rel(summed, residual + fp8.linear(x, w, b)) < TOL
    assert rel(parts.sum(1), summed.float().pow(2).sum(1)) < 1e-5


def test_quantize_tokens_rounds_as_torch_converts():
    """Per-token FP8 activations as `fp8.quantize_activations` rounds them, bit for bit:
    ties, values whose rounding carries into the next exponent (124.3 to 128), the
    subnormal range, an all-zero row, and the largest static scale."""
    x = torch.randn(6, 75, generator=torch.Generator().manual_seed(0)) * torch.tensor([1, 1e-3, 30, 1, 1, 0])[:, None]
    x[0, :4] = torch.tensor([124.3, -124.3, 448.0, 0.0]) / 448 * x[0].abs().max()
    x[3, :3] = torch.tensor([1e-5, -3e-4, 2.0])
    x = x.to(DEVICE, DTYPE)
    for activations, scales in (("dynamic", None), ("static", torch.tensor([0.02, 0.05], device=DEVICE))):
        weight = fp8.Fp8Weight(torch.zeros(8, 75, dtype=fp8.FP8_DTYPE, device=DEVICE),
                               torch.ones(8, device=DEVICE), activations, scales)
        q, s = triton_quantize.quantize_tokens(x, weight)
        assert q.dtype == fp8.FP8_DTYPE and s.dtype == torch.float32 and s.shape == (6,)
        assert torch.equal(q.float() * s[:, None], fp8.quantize_activations(x, weight))
        assert float(s[5]) == (1.0 if activations == "dynamic" else float(scales[1]))
        assert bool((q[5].float() == 0).all())


@pytest.mark.parametrize(("m", "n", "k", "bias"), [(40, 48, 96, True), (70, 50, 200, False), (33, 64, 64, True)])
def test_prefill_kernels_equal_their_emulated_numerics(m, n, k, bias):
    """More rows than decode's: the Triton GEMM that converts the weight in registers is
    the emulated product itself (with the weight's scheme); `prefill_scaled_mm`, which a
    prefill runs, quantizes each token's activations to FP8 first, the numerics of
    `fp8.product` for more than DECODE_ROWS rows, on shapes torch._scaled_mm takes
    (multiples of 16) and on those it does not (the Triton kernel then)."""
    x, w, b = fp8_operands(m, n, k, bias, seed=m + n + k)
    small = GemmConfig(16, 32, block_m=16, tile_m=True)
    assert rel(triton_fp8.prefill_dequant(x, w, b, small), fp8.linear(x, w, b)) < TOL
    assert rel(triton_fp8.prefill_scaled_mm(x, w, b), fp8.linear(x, fp8.dynamic(w), b)) < TOL
    assert rel(triton_fp8.linear(x, w, b), fp8.product(x, w, b)) < TOL


def test_fp8_operands_are_checked():
    x, w, _ = fp8_operands(4, 32, 64, False, seed=1)
    with pytest.raises(ValueError, match="an FP8 weight comes with its scales: pass an Fp8Weight"):
        triton_gemm.launch(x, w.weight, None, GemmConfig(16, 32))
    with pytest.raises(ValueError, match=r"needs float32 scales \[32\]"):
        triton_gemm.launch(x, w._replace(scale=w.scale[:8]), None, GemmConfig(16, 32))
    sums = x.float().pow(2).sum(1, keepdim=True)
    with pytest.raises(ValueError, match="a folded norm cannot feed a product whose input is quantized to FP8"):
        triton_gemm.launch(x, w._replace(activations="dynamic"), None, GemmConfig(16, 32), norm=FoldedNorm(1e-5, sums))
    with pytest.raises(ValueError, match=r"the norm weight of a product over 64 columns must be \[64\]"):
        triton_gemm.launch(x, w, None, GemmConfig(16, 32), norm=FoldedNorm(1e-5, sums, torch.ones(63)))
    with pytest.raises(ValueError, match="a config that tiles the rows needs its block_m and no split of K"):
        GemmConfig(16, 32, split_k=2, block_m=16, tile_m=True)


def test_the_description_says_where_prefill_quantizes_activations():
    """A prefill on the Triton kernels rounds activations to FP8 per token where the
    scheme keeps them in the model dtype: the status line says so; the torch kernels'
    prefill and a checkpoint's own activation scheme need no such note."""
    from hybridd.kernels.selection import select_kernels
    from hybridd.quantization import Quantization

    assert select_kernels("cpu", KernelChoices("triton")).fp8_prefill_per_token
    assert not select_kernels("cpu", KernelChoices("torch")).fp8_prefill_per_token
    assert "activations in the model dtype (FP8 per token in prefill);" in Quantization().describe(True)
    assert "activations in the model dtype;" in Quantization().describe(False)
    assert "activations FP8 per token;" in Quantization(activations="dynamic").describe(True)


def test_the_kernels_numerics_follow_the_row_count():
    """`fp8.product`, the GPU kernels' numerics: up to DECODE_ROWS rows (the skinny GEMM)
    the activations stay as the scheme says; more rows (the FP8 × FP8 prefill) are
    quantized per token; a checkpoint's static scheme is kept at every row count."""
    for m in (1, fp8.DECODE_ROWS, fp8.DECODE_ROWS + 1, 70):
        x, w, b = fp8_operands(m, 48, 64, True, seed=m)
        per_token = fp8.linear(x, fp8.dynamic(w), b)
        assert not torch.equal(fp8.linear(x, w, b), per_token), m  # the two numerics differ here
        assert torch.equal(fp8.product(x, w, b), fp8.linear(x, w, b) if m <= fp8.DECODE_ROWS else per_token), m
        static = w._replace(activations="static", input_scale=torch.tensor([0.05], device=x.device))
        assert torch.equal(fp8.product(x, static, b), fp8.linear(x, static, b)), m


# ---------------------------------------------------------------- the tiny model, Triton against torch


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def fp8_model_dir(request, tmp_path_factory):
    from tests.tiny_models import build_tiny_model

    path = tmp_path_factory.mktemp(f"fp8-{request.param}")
    build_tiny_model(request.param, path)
    return path


PROMPTS = [[5, 9, 3, 17, 2, 8, 11], [4, 30, 99] * 10, [7, 8]]  # a 42-token prefill: past the skinny rows


def _logits(model, prompts, decode_steps: int = 3, prefill_activations: str = "none"):
    """Logits of a prefill of `prompts` and `decode_steps` decode steps; the prefill's
    projections quantize their activations as `prefill_activations` says (the torch
    reference of the FP8 × FP8 prefill: "dynamic")."""
    from hybridd.model import KVCache, StepInputs

    kv = KVCache.allocate(model.config, 32, 4, DTYPE, DEVICE)
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(len(prompts))]
    projections = [p for layer in model.layers for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                         layer.down_proj)]
    for p in projections:
        p.activations = prefill_activations
    out = [model.forward_logits(StepInputs.prefill(prompts, tables, 4, DEVICE), kv)]
    for p in projections:
        p.activations = "none"
    for i in range(decode_steps):
        step = StepInputs.decode([3 + i] * len(prompts), [len(p) + i for p in prompts], tables, 4, DEVICE)
        out.append(model.forward_logits(step, kv))
    return torch.cat(out), kv


@torch.inference_mode()
@pytest.mark.parametrize("decode", ["dot", "fma", "dot_f16_t"])
def test_fp8_model_on_the_triton_kernels_equals_the_torch_kernels(fp8_model_dir, decode, monkeypatch):
    """The tiny model quantized to FP8 at load, its norms with random weights, through the
    Triton kernel set with every fusion (the norm applied on the activation side, RoPE
    with the KV write and the residual add in the projections' epilogues) against the
    torch kernel set on the same weights: a 42-token prefill (FP8 × FP8) and
    three decode steps (the skinny kernel). Logits and caches equal the torch path's up
    to the order of float32 sums, the torch path's prefill quantizing its activations per
    token, as the FP8 × FP8 prefill does (`fp8.product`). The decode steps (3 rows) run on the
    `decode` kernel form: the rule's tensor-core one, the CUDA-core one, or the float16
    one with W as the tensor cores' second operand (its activations rounded to float16:
    within float16's rounding of the float32 activations here)."""
    from hybridd.kernels.selection import select_kernels
    from hybridd.model import load_model

    model = load_model(fp8_model_dir, dtype=DTYPE, device=DEVICE, quantization="fp8", kernels="torch")
    g = torch.Generator().manual_seed(3)
    for layer in model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
    launched = []
    real_launch = triton_gemm.launch

    def counting_launch(x, weight, *args, **kwargs):
        if isinstance(weight, fp8.Fp8Weight):
            launched.append([k for k in ("rotary", "norm", "residual") if kwargs.get(k) is not None])
        return real_launch(x, weight, *args, **kwargs)

    monkeypatch.setattr(triton_gemm, "launch", counting_launch)
    # Small tiles: the interpreter's time goes with the tile's size.
    monkeypatch.setattr(triton_gemm, "config_for", lambda m, n, k, mps, weight_bytes=2, shared_bytes=None:
                        GemmConfig(16, 32, 2 if k > 64 else 1, kernel=decode if weight_bytes == 1 else "dot")
                        if m <= 32 else None)
    monkeypatch.setattr(triton_fp8, "prefill_config", lambda m, n, mps: GemmConfig(32, 32, block_m=32, tile_m=True))
    ref_logits, ref_kv = _logits(model, PROMPTS, prefill_activations="dynamic")
    model.kernels = select_kernels(DEVICE, KernelChoices("triton"))
    model.fold_norms()
    assert model.layers[0].input_layernorm.weight.float().std() > 0  # an FP8 model keeps its norms
    logits, kv = _logits(model, PROMPTS)
    tol = F16_TOL if decode == "dot_f16_t" else TOL
    assert rel(logits, ref_logits) < tol
    for i in range(model.config.num_layers):
        for got, want in zip(kv.layer(i), ref_kv.layer(i)):
            assert rel(got, want) < tol
    layers, decode_steps = model.config.num_layers, 3
    kinds = [k for call in launched for k in call]
    assert kinds.count("residual") == 2 * layers * decode_steps
    assert kinds.count("norm") == (2 * layers - 1) * decode_steps
    assert kinds.count("rotary") == layers * decode_steps


# ---------------------------------------------------------------- the GPU: the 7B and 8B shapes


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [LLAMA2_7B, LLAMA3_8B], ids=["llama2-7b", "llama3-8b"])
@pytest.mark.parametrize("m", [1, 16, 17, 32])  # both row tiles, each at its fullest and emptiest
def test_skinny_fp8_model_shapes(shapes, m):
    """Every projection of the two shapes at decode's row counts, with `config_of`'s own
    config (FP8's), against the emulated product, with a residual, a norm on the
    activation side and a bias."""
    for name, (n, k) in shapes.items():
        x, w, b = fp8_operands(m, n, k, name == "qkv", seed=m + n)
        assert rel(triton_gemm.skinny(x, w, b), fp8.linear(x, w, b)) < TOL, name
        g = 0.5 + torch.rand(k, device=DEVICE).to(DTYPE)
        sums = x.float().pow(2).sum(1, keepdim=True).contiguous()
        got = triton_gemm.skinny(x, w, None, norm=FoldedNorm(1e-5, sums, g))
        assert rel(got, fp8.linear(ref_ops.rms_norm(x, g, 1e-5), w)) < TOL, name
        residual = torch.randn(m, n, dtype=DTYPE, device=DEVICE)
        summed, _ = triton_gemm.skinny(x, w, None, residual=residual)
        assert rel(summed, residual + fp8.linear(x, w)) < TOL, name


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [LLAMA2_7B, LLAMA3_8B], ids=["llama2-7b", "llama3-8b"])
@pytest.mark.parametrize("m", [33, 500, 2048])
def test_prefill_kernels_model_shapes(shapes, m):
    """Both prefill kernels (the FP8 × FP8 product a prefill runs and the Triton GEMM it
    falls back to) on every projection of the two shapes, from just past the skinny
    kernel's rows to a long prompt, against their emulated numerics."""
    for name, (n, k) in shapes.items():
        x, w, b = fp8_operands(m, n, k, False, seed=m + n)
        assert rel(triton_fp8.prefill_dequant(x, w, b), fp8.linear(x, w, b)) < TOL, name
        assert rel(triton_fp8.prefill_scaled_mm(x, w, b), fp8.linear(x, fp8.dynamic(w), b)) < TOL, name
        assert rel(triton_fp8.linear(x, w, b), fp8.product(x, w, b)) < TOL, name


# ---------------------------------------------------------------- compiled for Hopper, on any host

_COMPILE_FOR_HOPPER = """
import json, re, subprocess, tempfile
from dataclasses import replace
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from hybridd.kernels import triton_fp8, triton_gemm, triton_quantize

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
# As a launch on the 7B shapes specializes them: pointers and every size but M divisible by 16.
UNALIGNED = ("M", "split_k", "n_stats", "n_static")


def compile_(kernel, types, constants, warps, stages):
    signature, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        if p.name in types:
            signature[p.name] = types[p.name]
            if types[p.name][0] == "*" or (types[p.name] == "i32" and p.name not in UNALIGNED):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[p.name] = "constexpr"
            consts[(i,)] = constants.get(p.name, p.default)
    options = backend.parse_options({"num_warps": warps, "num_stages": stages})
    k = triton.compile(ASTSource(kernel, signature, consts, attrs), target=target, options=options.__dict__)
    ptx = k.asm["ptx"]
    # The stack ptxas gave each thread (spilled registers), from the cubin's resource usage.
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(k.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    return {"shared": k.metadata.shared, "cp_async": "cp.async" in ptx,
            "e4m3": bool(re.search(r"cvt\\.[a-z0-9.]*e4m3", ptx)), "wgmma": "wgmma" in ptx,
            "mma": "mma.sync" in ptx,
            "stack": int(re.search(r"STACK:(\\d+)", usage).group(1))}


gemm = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "b_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
        "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "split_k": "i32",
        "stride_xm": "i32", "stride_ym": "i32", "w_scale_ptr": "*fp32"}
out = {}
# Each decode kernel form at the rule's tensor-core tiles (the CUDA-core one at its own
# tile), and every config `config_for` gives the Llama-2-7B and Llama-3-8B projections.
decode = [(f"{kernel}_m{m}", m, replace(triton_gemm.rule_config(max(m, 2), 4096, 4096, 132, 1), kernel=kernel))
          for m in (1, 32) for kernel in ("dot", "dot_f16", "dot_f16_t")]
decode += [(f"fma_m{m}_s{s}", m, triton_gemm.GemmConfig(16 if m <= 2 else 8, 256, 1, 4, s, kernel="fma"))
           for m in (1, 4, 8) for s in (1, 2)]
rule = {}
for n, k in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (6144, 4096), (28672, 4096), (4096, 14336)):
    for m in (1, 4, 32):
        c = triton_gemm.config_for(m, n, k, 132, 1)
        rule.setdefault((c, triton_gemm.block_m_of(c, m)), (f"config_for_{n}x{k}_m{m}", m, c))
decode += list(rule.values())
for name, m, c in decode:
    flags = dict(HAS_BIAS=False, SPLIT=False, EVEN_K=True, BLOCK_M=triton_gemm.block_m_of(c, m), BLOCK_N=c.block_n,
                 BLOCK_K=c.block_k, INTERPRET=False, PDL=False, W_SCALE=True,
                 MODE=triton_gemm.KERNELS.index(c.kernel), FMA_PREFETCH=c.kernel == "fma" and c.num_stages > 1)
    out[f"decode_{name}"] = compile_(triton_gemm._skinny_gemm_kernel, gemm, flags, c.num_warps, c.num_stages)
    out[f"decode_{name}"] |= {"kernel": c.kernel, "block_n": c.block_n}
    norm = {**gemm, "stats_ptr": "*fp32", "n_stats": "i32", "eps": "fp32", "g_ptr": "*bf16"}
    out[f"decode_norm_{name}"] = compile_(triton_gemm._skinny_gemm_kernel, norm,
                                          {**flags, "NORM": True, "STATS_PAD": 32, "NORM_WEIGHT": True},
                                          c.num_warps, c.num_stages)
    out[f"decode_norm_{name}"] |= {"kernel": c.kernel, "block_n": c.block_n}
for c in triton_fp8.prefill_configs():
    flags = dict(HAS_BIAS=False, SPLIT=False, EVEN_K=True, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                 INTERPRET=False, PDL=False, W_SCALE=True)
    out[f"prefill_{c.block_m}x{c.block_n}"] = compile_(triton_gemm._skinny_gemm_kernel, gemm, flags, c.num_warps,
                                                       c.num_stages)
quant = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "static_ptr": "*fp32", "n_cols": "i32",
         "n_static": "i32", "stride_x": "i32"}
out["quantize"] = compile_(triton_quantize._quantize_tokens_kernel, quant,
                           dict(STATIC=False, BLOCK=16384, STATIC_PAD=1, FP8_MAX=448.0, PDL=False), 8, 1)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_fp8_kernels_compile_for_hopper(tmp_path):
    """The FP8 GEMM (decode in each kernel form at both row tiles and the CUDA-core one at
    1-8 rows, and the configs `config_for` gives, with the norm on the activation side;
    every prefill config) and the quantization kernel compile for sm_90 with no GPU here,
    as the launches on the 7B shapes specialize them: the weight streamed into shared
    memory by the software pipeline (cp.async) for the tensor cores (wgmma, or mma.sync
    where W is the second operand or the weight tile has fewer than 64 rows), straight into registers for the CUDA cores, converted
    from E4M3 in registers, within an H100's shared memory, no register spilled (ptxas's
    stack, from the cubin)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.host_load import on_this_host

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, as in the daemon
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, cwd=root, capture_output=True,
                          text=True, timeout=on_this_host(300))
    assert done.returncode == 0, done.stderr[-4000:]
    kernels = json.loads(done.stdout.strip().splitlines()[-1])
    for name, k in kernels.items():
        assert k["shared"] <= 227 * 1024 and k["stack"] == 0, (name, k)
        assert k["e4m3"], (name, k)
        kernel = k.get("kernel", "dot")
        if kernel == "fma":  # the CUDA cores, the weight loaded straight into registers
            assert not (k["cp_async"] or k["wgmma"] or k["mma"]), (name, k)
        elif kernel == "dot_f16_t" or k.get("block_n", 64) < 64:  # W the second operand, or under wgmma's 64 rows
            assert k["cp_async"] and k["mma"], (name, k)
        elif name != "quantize":
            assert k["cp_async"] and k["wgmma"], (name, k)
