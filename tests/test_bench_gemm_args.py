"""scripts/bench_gemm.py, scripts/bench_attention.py and scripts/bench_pdl_steps.py refuse
bad arguments before they touch a GPU, naming what was wrong (the refusals run on any
host)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_gemm.py"
ATTENTION_SCRIPT = SCRIPT.parent / "bench_attention.py"
MLP_SCRIPT = SCRIPT.parent / "bench_mlp.py"


def run_script(script: Path, args: list[str]) -> subprocess.CompletedProcess:
    """One run of a bench script with `args`, its output captured."""
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("args", "message"), [
    (["--decode-batch", "0"], "--decode-batch: a comma list of batch sizes of at least 1, got '0'"),
    (["--decode-batch", "x,2"], "--decode-batch: a comma list of batch sizes of at least 1, got 'x,2'"),
    (["--decode-step", "--variants", "skinny+norm,bogus"], "--variants: no variant named bogus; the variants are cublas,"),
    (["--decode-shape", "llama9"], "argument --decode-shape: invalid choice: 'llama9'"),
    (["--decode-step", "--variants", "skinny+norm+rotary+mlp+pdl with mlp.CONFIG=64:256"],
     "mlp.CONFIG takes six positive integers GATE_UP_N:GATE_UP_K:GATE_UP_STAGES:DOWN_N:DOWN_K:DOWN_STAGES, got '64:256'"),
    (["--decode-step", "--old-attention", "/nonexistent/attention.py"], "--old-attention: no file /nonexistent/attention.py"),
])
def test_bad_arguments_are_refused_by_name(args, message):
    done = run_script(SCRIPT, args)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--out", "x", "--rows", "0"], "argument --rows: a comma list of row counts 1-32, got '0'"),
    (["--out", "x", "--configs", "64:256:4"],
     "argument --configs: a config is six or seven positive integers "
     "GATE_UP_N:GATE_UP_K:GATE_UP_STAGES:DOWN_N:DOWN_K:DOWN_STAGES[:WARPS], got '64:256:4'"),
    (["--out", "x", "--shape", "llama9"], "argument --shape: invalid choice: 'llama9'"),
    (["--out", "x", "--per-sm", "2,x"], "argument --per-sm: a comma list of programs a multiprocessor, 1-8, got '2,x'"),
])
def test_bench_mlp_refuses_bad_arguments_by_name(args, message):
    done = run_script(MLP_SCRIPT, args)
    assert done.returncode == 2
    assert message in done.stderr


def test_old_attention_loads_a_module_with_dataclasses(tmp_path):
    """An earlier triton_attention.py (whose DecodePlan is a dataclass) loads from a file."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_gemm import load_decode_attention
    finally:
        sys.path.remove(str(SCRIPT.parent))
    source = SCRIPT.parent.parent / "hybridd" / "model" / "triton_attention.py"
    copy = tmp_path / "old_attention.py"
    copy.write_text(source.read_text())
    fn = load_decode_attention(copy)
    assert fn.__name__ == "decode_attention" and fn.__module__ == "old_attention"


@pytest.mark.parametrize(("source", "message"), [
    ("def decode_attention(:\n", "does not load: SyntaxError"),
    ("raise RuntimeError('broken on import')\n", "does not load: RuntimeError: broken on import"),
    ("decode_attention = 3\n", "has no decode_attention function"),
])
@pytest.mark.parametrize(("script", "args"), [(SCRIPT, ["--decode-step", "--old-attention"]),
                                            (ATTENTION_SCRIPT, ["--old"])], ids=["bench_gemm", "bench_attention"])
def test_an_old_attention_module_that_does_not_serve_is_refused_by_name(tmp_path, script, args, source, message):
    module = tmp_path / "old_attention.py"
    module.write_text(source)
    done = subprocess.run([sys.executable, str(script), *args, str(module)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert f"{args[-1]}: {module} {message}" in done.stderr


def test_step_variants_set_only_knobs_the_attention_module_has():
    """Every decode-step variant names its settings in full, and the attention knobs it sets
    exist in hybridd/kernels/triton_attention.py with values of their type."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(SCRIPT.parent.parent))
    try:
        from scripts import bench_gemm
    finally:
        sys.path.pop(0)
    from hybridd.kernels import triton_attention

    variants = bench_gemm.step_variants(bench_gemm.step_config("llama2-7b"), with_pdl=True)
    assert all(len(v) == 6 for v in variants.values())
    knobs = {label: v[5] for label, v in variants.items() if v[5]}
    default = bench_gemm.gemm_fusions.DEFAULT.replace(",", "+")
    assert f"skinny+{default}+pdl attn b1 128 programs" in knobs
    assert "skinny+norm+pdl" in variants and f"skinny+{default}+pdl" not in variants  # the default is +prefetch0
    for label, settings in knobs.items():
        assert set(settings) <= set(bench_gemm.KNOBS), label
        for name, value in settings.items():
            module = bench_gemm._knob_module(name)
            assert type(value) is type(getattr(module, name.split(".")[1])), (label, name)
    for name in bench_gemm.KNOBS:
        assert hasattr(bench_gemm._knob_module(name), name.split(".")[1]), name
    assert bench_gemm._knob_module("attn.BATCH1_PROGRAMS") is triton_attention


def test_composed_variants_change_a_known_variant():
    """`BASE with CHANGE ...` takes BASE's settings and replaces a projection's config or
    sets a knob, in the knob's own type; anything else is refused by name."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(SCRIPT.parent.parent))
    try:
        from scripts import bench_gemm
    finally:
        sys.path.pop(0)
    cfg = bench_gemm.step_config("llama2-7b")
    known = bench_gemm.step_variants(cfg, with_pdl=True)
    base = "skinny+norm+rotary+pdl+prefetch0"
    skinny_on, fused, with_pdl, prefetch, table, knobs = bench_gemm.composed_variant(
        f"{base} with o=32:512:1:4:4 down=64:128:1:4:7:m64:p2048 attn.BATCH1_WARPS=4 attn.BATCH1_STAGES=2", known, cfg)
    assert (skinny_on, fused, with_pdl, prefetch) == known[base][:4]
    assert table == {(4096, 4096): [(32, bench_gemm.GemmConfig(32, 512, 1, 4, 4))],
                     (4096, 11008): [(32, bench_gemm.GemmConfig(64, 128, 1, 4, 7, block_m=64, prefetch_k=2048))]}
    assert knobs == {"attn.BATCH1_WARPS": 4, "attn.BATCH1_STAGES": 2}
    for label, message in [
        ("nothing with o=64:256:1:4:4", "no variant named 'nothing'"),
        (f"{base} with o=64:256", "block_n:block_k:split:warps:stages"),
        (f"{base} with o=64:256:1:4:4:tmx", "block_n:block_k:split:warps:stages"),
        (f"{base} with o=64:256:1:4:4:m48", "block_m must be"),
        (f"{base} with o=64:256:1:4:4:p512:p256", "block_n:block_k:split:warps:stages"),
        (f"{base} with attn.BATCH1_STAGES=two", "a knob takes an integer"),
        (f"{base} with attn.NOPE=3", "no projection or knob 'attn.NOPE'"),
        (f"{base} with attn.BATCH1_STAGES", "want NAME=integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            bench_gemm.composed_variant(label, known, cfg)


@pytest.mark.parametrize(("args", "message"), [
    (["--shapes", "llama2-7b x"], "--shapes: no projection llama2-7b x"),
    (["--shapes", "llama2-7b o", "--configs", "64:256"], "--configs: a comma list of block_n:block_k:split:warps:stages"),
    (["--shapes", "llama2-7b o", "--configs", "64:128:1:4:7:m64,64:128:1:4"], "--configs: a comma list of"),
    (["--decode-step", "--variants", "skinny+norm with o=1"], "--variants: 'o=1': a config is"),
])
def test_config_and_composed_arguments_are_refused_by_name(args, message):
    done = run_script(SCRIPT, args)
    assert done.returncode == 2
    assert message in done.stderr


def test_profile_target_names_what_it_needs():
    """The profiler target refuses, by name, a kernel it does not know and a machine
    without CUDA (where it has nothing to profile)."""
    script = SCRIPT.parent / "profile_target.py"
    done = run_script(script, ["lm_head"])
    assert done.returncode == 2 and "invalid choice: 'lm_head'" in done.stderr
    if not torch.cuda.is_available():
        done = run_script(script, ["attention"])
        assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr


PDL_STEPS_SCRIPT = SCRIPT.parent / "bench_pdl_steps.py"


CUBLASLT_SCRIPT = SCRIPT.parent / "bench_cublaslt.py"


READ_RAMP_SCRIPT = SCRIPT.parent / "bench_read_ramp.py"
BOUNDARY_SCRIPT = SCRIPT.parent / "bench_kernel_boundary.py"


@pytest.mark.parametrize(("script", "args", "message"), [(PDL_STEPS_SCRIPT, *case) for case in [
    (["--policies", "code,fast"], "no policy 'fast' in 'fast' (policies: code, pdl_throughout, cublas_prefill)"),
    (["--policies", "code with ops.ROTARY=2"], "'ops.ROTARY=2' in 'code with ops.ROTARY=2': want KNOB=VALUE"),
    (["--policies", "code with ops.ROTARY_SPLITS=2:4"], "ops.ROTARY_SPLITS takes one integer"),
    (["--policies", "code with ops.SILU_LAUNCH=1024"], "ops.SILU_LAUNCH takes a pair a:b"),
    (["--policies", "code with ops.ROTARY_WARPS=x"], "the value must be an integer or integers joined by ':'"),
    (["--prefill", "128,0"], "token counts must be at least 1, got '128,0'"),
    (["--policies", "code with table=/nonexistent/winners.json"], "/nonexistent/winners.json: not a table of entries"),
]] + [(CUBLASLT_SCRIPT, *case) for case in [
    (["--limit", "0"], "argument --limit: must be at least 1, got 0"),
    (["--rounds", "-1"], "argument --rounds: must be at least 0, got -1"),
    (["--splits-of", "two"], "argument --splits-of: must be an integer, got 'two'"),
]] + [(READ_RAMP_SCRIPT, *case) for case in [
    (["--sizes-mib", "32,0"], "--sizes-mib: a comma list of sizes of at least 1 MiB, got '32,0'"),
    (["--sizes-mib", "32,x"], "--sizes-mib: a comma list of sizes of at least 1 MiB, got '32,x'"),
]] + [(BOUNDARY_SCRIPT, *case) for case in [
    (["--phases-mib", "96"], "--phases-mib: a comma list of two or more sizes of at least 1 MiB, got '96'"),
    (["--phases-mib", "96,0"], "--phases-mib: a comma list of two or more sizes of at least 1 MiB, got '96,0'"),
    (["--phases-mib", "96,x"], "--phases-mib: a comma list of two or more sizes of at least 1 MiB, got '96,x'"),
]])
def test_bench_script_arguments_are_refused_by_name(script, args, message):
    done = run_script(script, args)
    assert done.returncode == 2
    assert message in done.stderr


def test_pdl_steps_knobs_are_launch_constants_of_the_kernels():
    """Each knob a policy may set is a constant of `triton_ops` of the kind it is parsed to."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_pdl_steps import KNOBS, parse_policy
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from hybridd.kernels import triton_ops

    for name, kind in KNOBS.items():
        default = getattr(triton_ops, name.split(".")[1])
        assert isinstance(default, kind) and (kind is int or len(default) == 2), name
    assert parse_policy("pdl_throughout with ops.ROTARY_SPLITS=4 ops.SILU_NORM_LAUNCH=2048:4") == (
        "pdl_throughout", {"ops.ROTARY_SPLITS": 4, "ops.SILU_NORM_LAUNCH": (2048, 4)})


def _bench_scripts():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_cublaslt
        import bench_pdl_steps
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return bench_cublaslt, bench_pdl_steps


def test_a_sweeps_winners_written_as_json_read_back_as_table_entries(tmp_path):
    bench_cublaslt, _ = _bench_scripts()
    from hybridd.kernels import prefill_gemm

    entries = {("NVIDIA H200", 256, 4096, 11008, True): prefill_gemm._lt(algo_id=66, tile=18, stages=35, cluster_shape=2),
               ("NVIDIA H200", 128, 22016, 4096, False): prefill_gemm._lt(algo_id=66, tile=201, custom=6, stages=35)}
    path = tmp_path / "winners.json"
    bench_cublaslt.write_table(path, entries)
    assert bench_cublaslt.read_table(path) == entries


@pytest.mark.parametrize(("content", "message"), [
    ("{}", "a table is a list of entries, got dict"),
    ('[{"gpu": "G", "rows": 128}]', "entry 0 must have exactly gpu, rows, n, k, accumulate, config"),
    ('[{"gpu": "G", "rows": true, "n": 1, "k": 1, "accumulate": false, "config": {"algo_id": 66}}]', "entry 0: rows malformed"),
    ('[{"gpu": "G", "rows": 128, "n": 1, "k": 1, "accumulate": false, "config": {"tile": 3}}]', "entry 0: config malformed"),
    ("[oops", "not a table of entries"),
])
def test_a_malformed_table_is_refused_with_what_is_wrong(tmp_path, content, message):
    bench_cublaslt, _ = _bench_scripts()
    path = tmp_path / "winners.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        bench_cublaslt.read_table(path)


def test_a_policys_table_is_in_force_for_its_graphs_alone(tmp_path):
    """`code with table=PATH` puts the file's entries over the code's table (the same
    products replaced, others kept) while the policy's graphs are made, and the code's
    table, its resolved entries and its policy are back afterwards."""
    bench_cublaslt, bench_pdl_steps = _bench_scripts()
    from hybridd.kernels import pdl, prefill_gemm

    code_table = prefill_gemm._TABLE
    replaced = next(iter(code_table))
    added = ("NVIDIA H200", 512, 4096, 4096, True)
    entries = {replaced: prefill_gemm._lt(algo_id=66, tile=1, stages=35), added: prefill_gemm._lt(algo_id=66, tile=2)}
    path = tmp_path / "winners.json"
    bench_cublaslt.write_table(path, entries)
    policy, knobs = bench_pdl_steps.parse_policy(f"cublas_prefill with table={path} ops.ROTARY_SPLITS=2")
    assert policy == "cublas_prefill" and knobs == {"table": entries, "ops.ROTARY_SPLITS": 2}
    before = (pdl.CUBLAS_STEPS, prefill_gemm.ENABLED)
    with bench_pdl_steps.policy_settings(f"code with table={path}"):
        assert prefill_gemm._TABLE[replaced] == entries[replaced]
        assert prefill_gemm._TABLE[added] == entries[added]
        assert len(prefill_gemm._TABLE) == len(code_table) + 1
    assert prefill_gemm._TABLE is code_table
    assert (pdl.CUBLAS_STEPS, prefill_gemm.ENABLED) == before
    with pytest.raises(RuntimeError), bench_pdl_steps.policy_settings("pdl_throughout"):
        assert pdl.CUBLAS_STEPS
        raise RuntimeError("a capture failed")
    assert (pdl.CUBLAS_STEPS, prefill_gemm.ENABLED) == before


def test_read_ramp_fit_recovers_fixed_cost_and_rate():
    """The least-squares line of bench_read_ramp.py gives back the fixed cost and the rate of
    times made from them, and the best line through noisy ones."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_read_ramp import fit_line
    finally:
        sys.path.remove(str(SCRIPT.parent))
    sizes = [float(mib << 20) for mib in (4, 32, 86, 172, 1024)]
    fixed, rate = fit_line(sizes, [2e-6 + s / 3e12 for s in sizes])
    assert fixed == pytest.approx(2e-6, rel=1e-6) and rate == pytest.approx(3e12, rel=1e-9)
    fixed, rate = fit_line([1.0, 2.0, 3.0], [1.0, 2.5, 3.0])
    assert fixed == pytest.approx(1 / 6) and rate == pytest.approx(1.0)
