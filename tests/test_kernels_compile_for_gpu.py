"""The Triton kernels compile for the GPUs hybridd serves on, from this host without one.

Triton's interpreter runs a kernel's Python on the CPU (the kernel tests), but not its
compiler: a kernel the interpreter runs may still be refused by the front end (a variable
whose type differs between paths, a function with two return types) or by the back end,
and on a GPU that failure stops every graph capture. Triton compiles for a target it is
given, to cubin with the ptxas it ships, with no driver (`tests/gpu_compile.py`), so the
kernel variants the product launches are compiled here for sm_90 (H100, H200) and, where
they run there too, sm_80 (A100): paged attention and the KV write over a model-dtype and
an FP8 KV cache (FP8 needs sm_89 and newer); the skinny GEMM in bf16 and float32, and with
the configs its rules give at the Llama projections for bf16 and FP8 weights (every form:
dot, dot_f16, dot_f16_t, fma) with the norm and residual fusions; the activations' FP8
quantization, the norm and SiLU·mul kernels.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridd.kernels import triton_gemm
from tests.daemon import clean_env

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

ATTENTION = "hybridd.kernels.triton_attention"


def _pointers(fp8: bool) -> dict[str, str]:
    cache = "fp8e4nv" if fp8 else "bf16"
    scales = "fp32" if fp8 else cache
    return {"kc_ptr": cache, "vc_ptr": cache, "ks_ptr": scales, "vs_ptr": scales, "bt_ptr": "i32", "len_ptr": "i32",
            "pos_ptr": "i32", "qsl_ptr": "i32", "slot_ptr": "i32", "part_o_ptr": "fp32", "part_lse_ptr": "fp32",
            "ticket_ptr": "i32", "cos_ptr": "fp32", "sin_ptr": "fp32", "k_ptr": "bf16", "v_ptr": "bf16"}


GEMM = "hybridd.kernels.triton_gemm:_skinny_gemm_kernel"


def _gemm_pointers(dtype: str, weight: str) -> dict[str, str]:
    pointers = {name: dtype for name in ("x_ptr", "b_ptr", "y_ptr", "kc_ptr", "vc_ptr", "res_ptr", "g_ptr")}
    return pointers | {"w_ptr": weight, "ws_ptr": "fp32", "count_ptr": "i32", "pos_ptr": "i32", "slot_ptr": "i32",
                       "cos_ptr": "fp32", "sin_ptr": "fp32", "stats_ptr": "fp32", "stats_out_ptr": "fp32",
                       "w_scale_ptr": "fp32", "x_scale_ptr": "fp32"}


def _skinny(overrides: dict) -> dict:
    """The skinny GEMM's constexprs: a plain product but for `overrides`."""
    return dict(HAS_BIAS=False, SPLIT=False, EVEN_K=True, INTERPRET=False, PDL=False, ROTARY=False, HEADS=1,
                KV_HEADS=1, HALF=64, NORM=False, STATS_PAD=16, RESIDUAL=False, W_SCALE=False, X_SCALE=False,
                NORM_WEIGHT=False, FMA_PREFETCH=False) | overrides


def _cases() -> list[dict]:
    cases = []

    def add(case_id, kernel, constexprs, pointers, capabilities, num_warps=4, num_stages=2):
        for capability in capabilities:
            cases.append({"id": f"{case_id}-sm{capability}", "kernel": kernel, "constexprs": constexprs,
                          "pointers": pointers, "capability": capability, "num_warps": num_warps,
                          "num_stages": num_stages})

    for fp8 in (False, True):
        cache = "fp8" if fp8 else "bf16"
        targets = (90,) if fp8 else (80, 90)
        for group, splits in ((1, 1), (4, 4)):
            add(f"decode-{cache}-group{group}-splits{splits}", f"{ATTENTION}:_decode_kernel", dict(
                GROUP=group, MERGE_ROWS=min(group, 4), ROWS=16, HEAD_DIM=128, PAGE=16, TILE=64, NUM_SPLITS=splits,
                NUM_HEADS=32, KV_HEADS=32 // group, PRECISION="tf32", INTERPRET=False, FP8=fp8, PDL=False,
            ), _pointers(fp8), targets, num_stages=3)
        # The step's own keys from the step (FRESH) where the cache holds them as they are.
        for split, fresh in ((False, False), (True, False), (False, True), (True, True))[:4 if not fp8 else 2]:
            add(f"prefill-{cache}-split{int(split)}-fresh{int(fresh)}", f"{ATTENTION}:_prefill_kernel", dict(
                GROUP=4, HEAD_DIM=128, PAGE=16, BLOCK_M=64, BLOCK_N=64, SEQS_PAD=16, NUM_HEADS=32, SPLIT=split,
                PRECISION="tf32", INTERPRET=False, FP8=fp8, FRESH=fresh, PDL=False,
            ), _pointers(fp8), targets)
        for row_norm in (False, True):
            add(f"kv-write-{cache}-norm{int(row_norm)}", "hybridd.kernels.triton_ops:_rotary_write_kv_kernel", dict(
                HEADS=8, KV_HEADS=2, HEADS_PAD=8, KV_PAD=2, HALF=64, ROW_NORM=row_norm, BLOCK_X=4096, FP8=fp8,
                INTERPRET=False, PDL=False,
            ), _pointers(fp8), targets)
    for dtype in ("bf16", "fp32"):
        add(f"skinny-{dtype}", GEMM, _skinny(dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, MODE=0)),
            _gemm_pointers(dtype, dtype), (80, 90), num_stages=3)
    # The configs the product's rules give at the Llama shapes (H100: 132 multiprocessors),
    # bf16 and FP8 weights, 1 and 16 rows, with the norm and residual fusions.
    for (n, k) in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)):
        for m in (1, 16):
            for fp8 in (False, True):
                config = (triton_gemm.fp8_rule_config if fp8 else triton_gemm.rule_config)(m, n, k, 132)
                if config is None or (config.kernel == "fma" and m > triton_gemm.FMA_ROWS):
                    continue
                constexprs = _skinny(dict(
                    BLOCK_M=triton_gemm.block_m_of(config, m), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                    SPLIT=config.split_k > 1, EVEN_K=k % config.block_k == 0, W_SCALE=fp8,
                    MODE=triton_gemm.KERNELS.index(config.kernel),
                    FMA_PREFETCH=config.kernel == "fma" and config.num_stages > 1,
                    NORM=n != 4096, NORM_WEIGHT=fp8 and n != 4096, STATS_PAD=32, RESIDUAL=n == 4096))
                add(f"skinny-{'fp8' if fp8 else 'bf16'}-{n}x{k}-m{m}-{config.kernel}", GEMM, constexprs,
                    _gemm_pointers("bf16", "fp8e4nv" if fp8 else "bf16"), (90,), num_warps=config.num_warps,
                    num_stages=config.num_stages)
    add("quantize-tokens", "hybridd.kernels.triton_quantize:_quantize_tokens_kernel",
        dict(STATIC=False, BLOCK=4096, STATIC_PAD=4, FP8_MAX=448.0, PDL=False),
        {"q_ptr": "fp8e4nv", "scale_ptr": "fp32", "static_ptr": "fp32"}, (90,))
    add("rms-norm-residual", "hybridd.kernels.triton_ops:_rms_norm_kernel",
        dict(HAS_RESIDUAL=True, BLOCK=4096, PDL=False), {}, (80, 90))
    add("silu-mul-norm", "hybridd.kernels.triton_ops:_silu_and_mul_kernel",
        dict(BLOCK=1024, ROW_NORM=True, BLOCK_H=4096, PDL=False), {}, (80, 90))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    """Every case compiled in one child process without the interpreter."""
    env = {k: v for k, v in clean_env().items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.gpu_compile"], input=json.dumps(CASES), capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("case", [case["id"] for case in CASES])
def test_kernel_compiles_for_the_gpu(compiled, case):
    assert compiled[case] == "ok", compiled[case]
