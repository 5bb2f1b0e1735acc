"""The kernel classifier of the bench's breakdown (`python -m hybridd.bench.breakdown
--trace`) on kernel names as the PyTorch profiler reports them on the H200 (cuBLAS,
Triton, PyTorch's own kernels), the attribution of GEMMs to projections by their
position in a step and the time a kernel adds under PDL, each from a profiler trace
written here and read by the tool as a user runs it; and the lab's plot of the bench's
results (docs/lab/benchmarks_plot.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def breakdown(tmp_path: Path, kernels: list[tuple[str, float, float]], *args: str) -> dict:
    """The tool's summary of a trace of `kernels` (name, start µs, duration µs), as the
    daemon's step trace names its files."""
    trace = tmp_path / "trace-graph-1.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur}
                                                 for name, start, dur in kernels]}))
    done = subprocess.run([sys.executable, "-m", "hybridd.bench.breakdown", "--trace", str(trace), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def back_to_back(names: list[str], start: float = 0.0) -> list[tuple[str, float, float]]:
    return [(name, start + i, 1.0) for i, name in enumerate(names)]


CATEGORIES = {
    "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "gemm",  # a main GEMM, "splitK" in its name
    "void cublasLt::splitKreduce_kernel<32, 16, int, __nv_bfloat16, __nv_bfloat16, float>": "gemm_reduce",
    "std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, __nv_bfloat16>": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>": "gemm",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)": "attention",
    "_decode_split_kernel": "attention",
    "_decode_merge_kernel": "attention",
    "_decode_kernel": "attention",
    "_prefill_kernel": "attention",
    "_skinny_gemm_kernel": "gemm",
    "_rotary_write_kv_kernel": "rope_kv",
    "_write_kv_kernel": "rope_kv",
    "_rms_norm_kernel": "norm",
    "_silu_and_mul_kernel": "other",
    "_quantize_tokens_kernel": "other",  # FP8 activations per token, before an FP8 x FP8 prefill GEMM
    "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda>": "other",
    "Memcpy DtoD (Device -> Device)": "other",
    "a_kernel_nobody_named": None,
}


def test_classify(tmp_path):
    out = breakdown(tmp_path, back_to_back(list(CATEGORIES)), "--layers", "1")
    assert {k["name"]: k["category"] for k in out["kernels"]} == CATEGORIES
    assert [u["name"] for u in out["unlisted_kernels"]] == ["a_kernel_nobody_named"]


LAYER = ["_rms_norm_kernel", "nvjet_qkv", "_rotary_write_kv_kernel", "_decode_split_kernel", "nvjet_o",
         "void cublasLt::splitKreduce_kernel<>", "_rms_norm_kernel", "nvjet_gate_up", "_silu_and_mul_kernel",
         "nvjet_down"]


def test_gemms_attributed_by_position(tmp_path):
    step = ["indexSelectLargeIndex", *LAYER, *LAYER, "_rms_norm_kernel", "gemvx_lm_head", "elementwise_copy"]
    out = breakdown(tmp_path, back_to_back(step), "--layers", "2")
    assert out["notes"] == []
    labels = [k["label"] for k in out["kernels"]]
    gemms = [c for c in labels if c.startswith("gemm")]
    assert gemms == ["gemm.qkv", "gemm.o", "gemm.o", "gemm.gate_up", "gemm.down"] * 2 + ["gemm.lm_head"]
    assert labels[0] == "other" and labels[3] == "rope_kv"
    out = breakdown(tmp_path, back_to_back(step), "--layers", "3")  # a count that does not fit: no guessing
    assert out["notes"] and "not attributed" in out["notes"][0]
    assert "gemm" in out["categories"] and "gemm.qkv" not in out["categories"]


def test_summary_splits_time_and_lists_unnamed_kernels(tmp_path):
    """Two steps of 23 kernels of 1 µs, the second 30 µs after the first began: the trace
    spans 53 µs, 26.5 a step, 3.5 of them between kernels."""
    step = ["mystery", *LAYER, *LAYER, "_rms_norm_kernel", "gemvx_lm_head"]
    out = breakdown(tmp_path, back_to_back(step) + back_to_back(step, start=30.0), "--layers", "2", "--steps", "2")
    cats = out["categories"]
    assert out["steps_profiled"] == 2 and out["kernels_per_step"] == 23
    assert cats["gemm.o"]["kernels_per_step"] == 4 and cats["gemm.o"]["time_s"] == pytest.approx(4e-6)
    assert out["step_s"] == pytest.approx(26.5e-6) and cats["gaps"]["time_s"] == pytest.approx(3.5e-6)
    assert [u["name"] for u in out["unlisted_kernels"]] == ["mystery"]


def test_overlapping_kernels_count_only_the_time_they_add(tmp_path):
    """Under PDL a kernel starts while its predecessor runs and waits for it: it is
    charged from the predecessor's end; kernels that do not overlap keep their duration,
    and a gap between kernels is charged to neither."""
    kernels = [("a", 0.0, 10.0), ("b", 4.0, 12.0), ("c", 16.5, 3.5), ("d", 25.0, 2.0), ("e", 26.0, 0.5)]
    out = breakdown(tmp_path, kernels, "--layers", "1")
    assert [k["name"] for k in out["kernels"]] == ["a", "b", "c", "d", "e"]
    assert [round(k["seconds"] * 1e6, 6) for k in out["kernels"]] == [10.0, 6.0, 3.5, 2.0, 0.0]
    assert out["kernel_s"] * 1e6 == pytest.approx(27.0 - 5.0 - 0.5)  # the busy union


@pytest.mark.parametrize(("args", "says"), [(["--trace", "t.json"], "--trace needs --layers"),
                                            (["--layers", "2"], "--model or --trace is required"),
                                            (["--trace", "t.json", "--layers", "2", "--steps", "0"], "--steps")])
def test_a_wrong_invocation_is_named(args, says):
    done = subprocess.run([sys.executable, "-m", "hybridd.bench.breakdown", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr, done.stderr


def benchmarks_plot():
    """docs/lab/benchmarks_plot.py, the lab's plot script (not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location("benchmarks_plot", ROOT / "docs" / "lab" / "benchmarks_plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plot_draws_no_categories_from_a_profile_whose_kernels_overlap():
    plot = benchmarks_plot()

    def run(kernel_s: float, attribution: str | None) -> dict:
        step = {"step_s": 0.004, "kernel_s": kernel_s, "categories": {"attention": {"time_s": kernel_s}}}
        breakdown = {"decode_b1": step}
        if attribution:
            breakdown["attribution"] = attribution
        return {"breakdown": breakdown}

    assert plot.overlapping_steps(run(0.0065, None)) == ["decode_b1"]  # PDL summed twice
    assert plot.overlapping_steps(run(0.0039, None)) == []  # no overlap: kernels within the step
    assert plot.overlapping_steps(run(0.0065, "exclusive")) == []


def test_the_itl_panel_shows_each_client_of_hybridd_then_the_peers_on_hybridds_scale(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def itl(p50: float, p99: float) -> dict:
        return {"p50_s": p50, "p99_s": p99}

    results = {"floors": {"decode_floor_s": 0.0032},
               "hybridd": {"itl": itl(0.0037, 0.0041), "itl_ring": itl(0.0037, 0.0038),
                           "itl_polling_client": itl(0.0037, 0.0047)},
               "hf_eager": {"itl": itl(0.0376, 0.107)}}
    plot = benchmarks_plot()
    labels = [label for label, _, _, _ in plot.itl_bars(results)]
    assert labels == ["hybridd\nSDK", "hybridd\nraw client,\npolling", "hybridd\nSDK,\nreply ring", "HF generate\neager"]
    fig, ax = plt.subplots()
    plot.itl_panel(ax, results)
    top = ax.get_ylim()[1]
    assert 4.7 < top < 10  # hybridd's slowest p99 (4.7 ms) fits; the peer's 37.6 ms does not set the scale
    assert max(patch.get_height() for patch in ax.patches) == pytest.approx(top)  # the peer's bar, cut at the top
    assert any("37.6 ms" in text.get_text() for text in ax.texts)
    plt.close(fig)


@pytest.mark.parametrize(("content", "says"), [(None, "cannot read it"), ("not json", "not JSON"),
                                               ("[1]", "expected a JSON object")])
def test_the_plot_refuses_a_file_that_is_not_a_bench_result_by_name(tmp_path, content, says):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "lab" / "benchmarks_plot.py"),
                           str(path), "--png", str(tmp_path / "out.png")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"{path}: {says}" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out.png").exists()
