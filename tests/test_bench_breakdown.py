"""The kernel classifier of scripts/bench_breakdown.py on kernel names as the PyTorch
profiler reports them on the H200 (cuBLAS, Triton, PyTorch's own kernels), and the
attribution of GEMMs to projections by their position in a step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_breakdown as bb  # noqa: E402


@pytest.mark.parametrize("name, category", [
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm"),  # a main GEMM, "splitK" in its name
    ("void cublasLt::splitKreduce_kernel<32, 16, int, __nv_bfloat16, __nv_bfloat16, float>", "gemm_reduce"),
    ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, __nv_bfloat16>", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "gemm"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
    ("_decode_split_kernel", "attention"),
    ("_decode_merge_kernel", "attention"),
    ("_decode_kernel", "attention"),
    ("_prefill_kernel", "attention"),
    ("_skinny_gemm_kernel", "gemm"),
    ("_rotary_write_kv_kernel", "rope_kv"),
    ("_write_kv_kernel", "rope_kv"),
    ("_rms_norm_kernel", "norm"),
    ("_silu_and_mul_kernel", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda>", "other"),
    ("Memcpy DtoD (Device -> Device)", "other"),
    ("a_kernel_nobody_named", None),
])
def test_classify(name, category):
    assert bb.classify(name) == category


LAYER = ["_rms_norm_kernel", "nvjet_qkv", "_rotary_write_kv_kernel", "_decode_split_kernel", "nvjet_o",
         "void cublasLt::splitKreduce_kernel<>", "_rms_norm_kernel", "nvjet_gate_up", "_silu_and_mul_kernel",
         "nvjet_down"]


def test_gemms_attributed_by_position():
    step = ["indexSelectLargeIndex", *LAYER, *LAYER, "_rms_norm_kernel", "gemvx_lm_head", "elementwise_copy"]
    labels, note = bb.attribute(step, num_layers=2)
    assert note is None
    gemms = [(n, c) for n, c in zip(step, labels) if c.startswith("gemm")]
    assert [c for _, c in gemms] == ["gemm.qkv", "gemm.o", "gemm.o", "gemm.gate_up", "gemm.down"] * 2 + \
        ["gemm.lm_head"]
    assert labels[0] == "other" and labels[3] == "rope_kv"
    _, note = bb.attribute(step, num_layers=3)  # a count that does not fit the model: no guessing
    assert note and "not attributed" in note


def test_summary_splits_time_and_lists_unnamed_kernels():
    from types import SimpleNamespace

    config = SimpleNamespace(hidden_size=64, q_size=64, kv_size=32, intermediate_size=176, vocab_size=1024,
                             num_layers=2)
    step = [(n, 1e-6) for n in ["mystery", *LAYER, *LAYER, "_rms_norm_kernel", "gemvx_lm_head"]]
    floors = bb.step_floors(config, 1, 1, 512, False, 2, 1e12, 1e14)
    out = bb.summarize([step, step], 2, step_s=30e-6, floors=floors)
    cats = out["categories"]
    assert cats["gemm.o"]["kernels_per_step"] == 4 and cats["gemm.o"]["time_s"] == pytest.approx(4e-6)
    assert cats["gaps"]["time_s"] == pytest.approx(30e-6 - len(step) * 1e-6)
    assert [u["name"] for u in out["unlisted_kernels"]] == ["mystery"]
    assert cats["attention"]["floor_bytes"] == 2 * (512 * 2 * 32 + 2 * 64) * 2  # the KV read dominates


def test_overlapping_kernels_count_only_the_time_they_add():
    """Under PDL a kernel starts while its predecessor runs and waits for it: it is
    charged from the predecessor's end; kernels that do not overlap keep their duration,
    and a gap between kernels is charged to neither."""
    intervals = [(0.0, 10.0, "graph:a"), (4.0, 16.0, "graph:b"), (16.5, 20.0, "graph:c"), (25.0, 27.0, "graph:d"),
                 (26.0, 26.5, "graph:e")]
    times = bb.exclusive_times(intervals)
    assert [name for name, _ in times] == ["a", "b", "c", "d", "e"]
    assert [round(t * 1e6, 6) for _, t in times] == [10.0, 6.0, 3.5, 2.0, 0.0]
    assert sum(t for _, t in times) * 1e6 == pytest.approx(27.0 - 5.0 - 0.5)  # the busy union


def test_the_plot_draws_no_categories_from_a_profile_whose_kernels_overlap():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs" / "lab"))
    import benchmarks_plot

    def run(kernel_s: float, attribution: str | None) -> dict:
        step = {"step_s": 0.004, "kernel_s": kernel_s, "categories": {"attention": {"time_s": kernel_s}}}
        breakdown = {"decode_b1": step}
        if attribution:
            breakdown["attribution"] = attribution
        return {"breakdown": breakdown}

    assert benchmarks_plot.overlapping_steps(run(0.0065, None)) == ["decode_b1"]  # PDL summed twice
    assert benchmarks_plot.overlapping_steps(run(0.0039, None)) == []  # no overlap: kernels within the step
    assert benchmarks_plot.overlapping_steps(run(0.0065, "exclusive")) == []


def test_the_itl_panel_shows_each_client_of_hybridd_then_the_peers_on_hybridds_scale(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs" / "lab"))
    import benchmarks_plot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def itl(p50: float, p99: float) -> dict:
        return {"p50_s": p50, "p99_s": p99}

    results = {"floors": {"decode_floor_s": 0.0032},
               "hybridd": {"itl": itl(0.0037, 0.0041), "itl_ring": itl(0.0037, 0.0038),
                           "itl_polling_client": itl(0.0037, 0.0047)},
               "hf_eager": {"itl": itl(0.0376, 0.107)}}
    labels = [label for label, _, _, _ in benchmarks_plot.itl_bars(results)]
    assert labels == ["hybridd\nSDK", "hybridd\nraw client,\npolling", "hybridd\nSDK,\nreply ring", "HF generate\neager"]
    fig, ax = plt.subplots()
    benchmarks_plot.itl_panel(ax, results)
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
    done = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "docs" / "lab" / "benchmarks_plot.py"),
                           str(path), "--png", str(tmp_path / "out.png")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"{path}: {says}" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out.png").exists()
