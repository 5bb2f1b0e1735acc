"""Smoke test of the benchmark (`python -m hybridd.bench`): the whole benchmark on the CPU with a tiny random model
(`--device cpu --preset tiny --quick`), run as a subprocess as the lead runs it on the GPU;
checks that it finishes and that bench.json has every expected figure, and that the
plotting step reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.host_load import on_this_host

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):  # caches an earlier run left
        cache = out / name.lower()
        cache.mkdir()
        (cache / "left-by-an-earlier-run").write_text("")
        env[name] = str(cache)
    proc = subprocess.run(
        [sys.executable, "-m", "hybridd.bench", "--out", str(out / "out"), "--device", "cpu",
         "--preset", "tiny", "--quick", "--checkpoint-dir", str(out / "ckpt"), "--skip",
         "mixed_load,prefix_reuse,structured,speculation,speculation_steps,speculation_client,breakdown_fp8,fp8",
         "--budget-s",
         str(int(on_this_host(200)))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=on_this_host(300),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out / "out", proc.stdout


def test_json_has_every_figure(bench_out):
    out, stdout = bench_out
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench_table.txt"]
    r = json.loads((out / "bench.json").read_text())
    assert r["meta"]["errors"] == {}, r["meta"]["errors"]
    cuda_only = {"hf_static", "hybridd_no_mps", "hybridd_no_pdl", "hybridd_unfused", "hybridd_poll", "hybridd_no_wake"}
    # Their own runs below.
    assert set(r["meta"]["skipped"]) == cuda_only | {"mixed_load", "prefix_reuse", "structured", "speculation",
                                                     "speculation_steps", "speculation_client", "breakdown_fp8",
                                                     "fp8"}
    assert r["meta"]["shape"] == "tiny shape, random float32 weights"
    assert r["device"]["copy_bandwidth_Bps"] > 0 and r["device"]["matmul_flops"] > 0
    floors = r["floors"]
    assert floors["decode_floor_s"] > 0 and set(floors["prefill_floor_s"]) == {"10", "32", "128", "256", "500"}
    for name in ("hybridd", "hybridd_eager", "hf_eager"):
        part = r[name]
        assert set(part["ttft_s"]) == {"10", "32", "128", "256", "500"}, name
        assert all(v["median_s"] > 0 and v["n"] >= 2 for v in part["ttft_s"].values()), name
        assert part["itl"]["p50_s"] > 0 and part["itl"]["p99_s"] >= part["itl"]["p50_s"], name
        assert part["itl"]["n"] == 31, name  # 32 tokens, 31 gaps, one measured run (--quick)
        (run,) = part["itl"]["runs"]
        assert len(run["slowest"]) == 6 and all(0 <= i < 31 for i, _ in run["slowest"]), name
        assert min(gap for _, gap in run["slowest"]) >= run["p50_s"], name
    hy = r["hybridd"]
    # A first start on the host (--first-start, the default): compile caches of its own, empty;
    # the other parts start on the caches the environment names.
    assert hy["startup"]["compile_cache_files_at_spawn"] == {"triton": 0, "inductor": 0}
    assert r["hybridd_eager"]["startup"]["compile_cache_files_at_spawn"] == {"triton": 1, "inductor": 1}
    assert "concurrency" not in r["hybridd_eager"]  # the graphs-on daemon's figures alone
    assert set(hy["concurrency"]) == {"1", "4", "16", "32"}
    assert all(c["tokens_per_s"] > 0 and c["itl_p50_s"] > 0 for c in hy["concurrency"].values())
    assert hy["concurrency"]["32"]["tokens"] == 32 * 16
    assert hy["startup"]["spawn_to_ready_s"] > 0 and hy["startup"]["after_weights_to_ready_s"] is not None
    assert {"during", "early", "steady", "p99_ratio", "capture_window_s"} <= set(hy["background_capture"])
    assert hy["graph_memory"]["buckets"] and "graph_pool_bytes" in hy["graph_memory"]
    # The SDK as a user gets it: replies by the reply ring the daemon attaches.
    assert "hybridd.Client.stream: replies by the reply ring" in hy["client"], hy["client"]
    names = [t["target"] for t in r["targets"]]
    assert names[:5] == ["decode GPU step, batch 1, context 512, steps back to back (x weights floor)",
                         "decode ITL p50, batch 1",
                         "decode ITL p50, batch 1 (stretch)", "decode ITL p99/p50, batch 1",
                         "TTFT at the client 10-500 tokens (worst length)"]
    assert len(names) == 12 and all(t["value"] is not None for t in r["targets"]), r["targets"]
    # The forced captures' figure where they gave gaps enough for a p99 (a busy host may
    # not), else the background capture's.
    forced = r["capture_evict"]["p99_ratio"] is not None
    assert names[7].startswith(f"ITL p99 during {'forced prefill' if forced else 'background'} capture / steady")
    gateway = hy["gateway"]
    for side in ("sdk", "http"):
        # An HTTP event's time is its last byte's recv: on a busy host several events can
        # arrive in one read, and their gaps are then 0 (so the ITL p50 may be 0).
        assert gateway[side]["ttft_p50_s"] > 0 and gateway[side]["itl_p50_s"] >= 0, gateway
        assert gateway[side]["itl_n"] == 31, gateway
    assert gateway["sdk"]["itl_p50_s"] > 0, gateway
    assert gateway["added_ttft_p50_s"] is not None and gateway["added_itl_p50_s"] is not None
    assert r["targets"][-1]["target"].startswith("HTTP gateway: ITL p50 added")
    figures = [row["figure"] for row in r["table"]]
    assert figures[:5] == [f"TTFT {n} tok" for n in (10, 32, 128, 256, 500)] and "ITL p50 (b=1)" in figures
    assert "targets (BENCHMARKS.md)" in stdout and "TTFT 500 tok" in stdout


def test_kernel_breakdown(bench_out):
    """Each step kind split into categories with their floors; on the CPU the "kernels"
    are the eager step's top-level operators, so the projections are found by position."""
    out, stdout = bench_out
    bd = json.loads((out / "bench.json").read_text())["breakdown"]
    for key, tokens in (("decode_b1", 1), ("decode_b32", 32), ("prefill_16", 16), ("prefill_128", 128)):
        step = bd[key]
        assert step["tokens"] == tokens and step["step_s"] > 0 and step["floor_s"] > 0, key
        cats = step["categories"]
        assert list(cats) == ["gemm.qkv", "gemm.o", "gemm.gate_up", "gemm.down", "gemm.lm_head", "attention", "norm",
                              "rope_kv", "other", "gaps"], (key, list(cats), step["notes"])
        assert all(cats[c]["time_s"] > 0 and cats[c]["floor_s"] > 0 for c in list(cats)[:6]), key
        assert cats["gemm.qkv"]["kernels_per_step"] == 2  # one per layer of the tiny model
        assert all(u["name"] and u["time_s"] >= 0 for u in step["unlisted_kernels"])
    assert bd["decode_b32"]["weights_kv_floor_s"] > bd["decode_b1"]["weights_kv_floor_s"]
    assert "where the step goes" in stdout and "gemm.gate_up" in stdout


def test_capture_forced_during_decode(bench_out):
    """The small budget and the demand for the evicted bucket make the daemon capture
    prefill graphs while the decode stream runs."""
    out, stdout = bench_out
    ce = json.loads((out / "bench.json").read_text())["capture_evict"]
    assert ce["captures_during_decode"] >= 1 and ce["evictions"] >= 1, ce
    assert ce["steady"]["n"] > 20 and ce["during"]["n"] >= 1, ce
    assert "forced prefill capture" in stdout
    # The longest gaps inside the windows, longest first. A counted gap starts after its
    # trigger's first token: one that overlaps the trigger's own prefill is left out.
    longest = ce["longest_during_gaps"]
    assert 1 <= len(longest) <= 3 and [x["gap_s"] for x in longest] == sorted((x["gap_s"] for x in longest), reverse=True)
    assert longest[0]["gap_s"] == ce["during"]["max_s"]
    assert all(x["after_first_token_s"] >= 0 and x["bucket"] in (ce["plan"]["x"], ce["plan"]["y"])
               for x in longest), longest
    assert "longest gaps during captures" in stdout


def test_plot(bench_out, tmp_path):
    pytest.importorskip("matplotlib")
    out, _ = bench_out
    png = tmp_path / "bench.png"
    subprocess.run([sys.executable, str(ROOT / "docs" / "lab" / "benchmarks_plot.py"), str(out / "bench.json"), "--png",
                    str(png)], check=True, cwd=ROOT, timeout=120)
    assert png.stat().st_size > 10_000


def test_an_unknown_part_to_skip_is_named():
    """A part's old name (hybridd_mps became hybridd_no_mps) or a typo is refused before
    any work, not silently measured."""
    result = subprocess.run([sys.executable, "-m", "hybridd.bench", "--device", "cpu", "--out",
                             "/nonexistent/never-written", "--skip", "gateway,hybridd_mps"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--skip: unknown part(s) hybridd_mps; the parts are" in result.stderr
    assert "hybridd_no_mps" in result.stderr


def test_an_unknown_part_to_run_is_named():
    """Through `hybridd bench`: the command hands every argument to the bench's own parser."""
    result = subprocess.run([sys.executable, "-m", "hybridd.cli", "bench", "--device", "cpu", "--out",
                             "/nonexistent/never-written", "--parts", "ceilings,bench_gemm"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--parts: unknown part(s) bench_gemm; the parts are" in result.stderr


def test_hybridd_bench_help_is_the_bench_s_own():
    result = subprocess.run([sys.executable, "-m", "hybridd.cli", "bench", "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: hybridd bench") and "--budget-s" in result.stdout


def test_mixed_load_prefix_reuse_and_structured_parts(tmp_path):
    """The chunked-prefill, prefix-cache and structured-output parts, small: a stream beside
    another client's long prompts, TTFT with a cached prefix and over a chat's turns, and
    ITL under a JSON schema against unconstrained at batch 1 and 32 streams."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "hybridd.bench", "--out", str(tmp_path / "out"), "--device", "cpu", "--preset", "tiny",
         "--quick", "--checkpoint-dir", str(tmp_path / "ckpt"), "--parts",
         "ceilings,checkpoint,mixed_load,prefix_reuse,structured",
         "--long-prompt", "300", "--turn-tokens", "40", "--budget-s", str(int(on_this_host(200)))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=on_this_host(300),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert r["meta"]["errors"] == {}, r["meta"]["errors"]
    mixed, reuse = r["mixed_load"], r["prefix_reuse"]
    assert mixed["itl_alone"]["n"] == mixed["itl_during"]["n"] == 31
    assert mixed["ttft_during"]["n"] >= 1 and mixed["itl_p50_ratio"] > 0 and mixed["ttft_ratio"] > 0
    assert set(mixed["targets_met"]) == {"itl_p50 <= 1.5x", "itl_p99 <= 2.5x", "ttft <= 1.3x"}
    assert reuse["ttft_cold"]["n"] == reuse["ttft_repeated"]["n"] == reuse["ttft_shared_prefix"]["n"] == 3
    assert len(reuse["chat_ttft_s"]) == 8 and reuse["chat_history_tokens"] == 8 * (40 + 8)
    # The figures only: whether a repeated prompt's blocks are found cached is the runtime
    # tests' to say (tests/test_runtime_prefix_cache.py, by the tokens the daemon reports),
    # not a timing on a shared host.
    assert reuse["repeated_ratio"] > 0 and reuse["shared_prefix_ratio"] > 0
    longest = reuse["longest_prompt"]
    assert longest["served"] and longest["refused"] and longest["ttft_s"] > 0, longest
    structured = r["structured"]
    assert structured["batch_1"]["itl_schema"]["n"] == 2 * 3 * 31  # two passes of 3 prompts, 32 tokens each
    assert structured["streams_32"]["itl_schema"]["n"] == 2 * 32 * 31
    assert structured["batch_1"]["itl_p50_ratio"] > 0 and structured["streams_32"]["itl_p50_ratio"] > 0
    assert structured["compile"]["compile_p50_s"] > 0 and structured["ttft_new_schema"]["n"] == 3
    assert set(structured["targets_met"]) == {"batch 1 itl <= 1.10x", "32 streams itl <= 1.20x"}


def test_fp8_parts(tmp_path):
    """The FP8 parts, small: the breakdown of the model quantized at load (its GEMM floors
    on the FP8 bytes), and a bf16 (here float32) and an FP8 daemon on the same weights,
    each figure of the FP8 one over the other's, and the targets they feed; then FP8
    weights with an FP8 KV cache, its decode figures over the FP8 daemon's and more blocks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "hybridd.bench", "--out", str(tmp_path / "out"), "--device", "cpu", "--preset", "tiny",
         "--quick", "--checkpoint-dir", str(tmp_path / "ckpt"), "--parts", "ceilings,checkpoint,breakdown_fp8,fp8",
         "--long-prompt", "300", "--budget-s", str(int(on_this_host(200)))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=on_this_host(300),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert r["meta"]["errors"] == {}, r["meta"]["errors"]
    bd = r["breakdown_fp8"]
    assert bd["quantization"] == "fp8" and bd["decode_b1"]["step_s"] > 0
    assert bd["weight_bytes"] < r["floors"]["weight_bytes"]  # FP8 projections: fewer bytes than the float32 model's
    f8 = r["fp8"]
    assert f8["ttft_lengths"] == [128, 300]
    assert f8["bf16"]["quantization"] is None and f8["fp8"]["quantization"]["method"] == "fp8"
    for name in ("bf16", "fp8"):
        assert set(f8[name]["ttft_s"]) == {"128", "300"} and f8[name]["itl"]["n"] == 31
        assert f8[name]["concurrency"]["32"]["decode_tokens_per_s"] > 0
    assert all(v > 0 for v in f8["fp8_over_bf16"].values()), f8["fp8_over_bf16"]
    kv = f8["fp8_kv"]
    assert kv["kv_cache_dtype"] == "float8_e4m3fn" and f8["fp8"]["kv_cache_dtype"] == "float32"
    assert kv["itl"]["n"] == 31 and kv["concurrency"]["32"]["decode_tokens_per_s"] > 0
    assert kv["kv_blocks"] > 3 * f8["fp8"]["kv_blocks"]  # float32 head vectors against FP8 ones and their scales
    assert set(f8["fp8_kv_over_fp8"]) == {"itl_p50", "itl_p99", "decode_tokens_per_s_32"}
    assert all(v > 0 for v in f8["fp8_kv_over_fp8"].values()), f8["fp8_kv_over_fp8"]
    names = {t["target"].split(" (")[0] for t in r["targets"]}
    assert {"FP8 decode GPU step, batch 1, context 512", "FP8 / bf16 ITL p50, batch 1",
            "FP8 start to ready after weights are loaded"} <= names
    table = (tmp_path / "out" / "bench_table.txt").read_text()
    assert "FP8 against bf16" in table and "FP8 KV cache" in table


def test_fp8_gemm_bench_runs(tmp_path):
    """hybridd/bench/fp8.py end to end on the CPU (its kernels in Triton's interpreter, tiny
    shapes): every figure the GPU run reports is there, each prefill row count names a
    winner. The numbers are the GPU's to give."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "fp8_gemm.json"
    proc = subprocess.run([sys.executable, "-m", "hybridd.bench.fp8", "--out", str(out), "--device", "cpu",
                           "--shapes", "tiny", "--quick"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=on_this_host(300))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert set(r["decode"]) == {f"tiny.{p}.m{m}" for p in ("qkv", "o", "gate_up", "down") for m in (1, 17)}
    assert all(d["fp8_s"] > 0 and d["bf16_s"] > 0 and d["fp8_x_copy_bw"] > 0 and d["rule_s"] >= d["fp8_s"]
               for d in r["decode"].values())
    prefill = r["prefill"]
    assert set(prefill["projections"]) == {f"tiny.{p}.m40" for p in ("qkv", "o", "gate_up", "down")}
    assert all(p["scaled_mm_s"] > 0 and p["dequant_s"] > 0 and p["bf16_cublas_s"] > 0
               for p in prefill["projections"].values())
    assert prefill["layer"]["tiny.m40"]["winner"] in ("scaled_mm", "dequant")


def test_speculation_parts(tmp_path):
    """The speculative decoding parts, small: tokens/s with and without speculation in one
    daemon, verify-step times and time per token at set acceptances with the replay drafter
    (whose output must equal decoding without speculation at every acceptance), the EAGLE-3
    head's draft work and the replay figures with it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "hybridd.bench", "--out", str(tmp_path / "out"), "--device", "cpu", "--preset", "tiny",
         "--quick", "--checkpoint-dir", str(tmp_path / "ckpt"),
         "--parts", "ceilings,checkpoint,speculation,speculation_steps", "--budget-s", str(int(on_this_host(300)))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=on_this_host(400),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert r["meta"]["errors"] == {}, r["meta"]["errors"]
    for streams in ("streams_1", "streams_4"):
        figures = r["speculation"][streams]
        assert figures["tokens_per_s_speculative"] > 0 and figures["tokens_per_s_plain"] > 0
    assert r["speculation"]["status"]["drafter"] == "ngram"
    steps = r["speculation_steps"]
    assert set(steps["verify_steps"]) == {"context_tokens", "batch_1", "batch_4", "batch_16"}
    assert steps["verify_steps"]["batch_1"]["k8"]["step_s"] > 0
    replay = steps["replay"]
    assert all(replay[f"acceptance_{a}"]["same_tokens"] for a in (0, 50, 75, 80, 100)), replay
    assert replay["acceptance_100"]["mean_acceptance_length"] > replay["acceptance_0"]["mean_acceptance_length"] == 1
    # The target made predictable: every draft of the recorded continuation is kept.
    assert replay["acceptance_100"]["measured_acceptance"] == 1.0, replay
    # The EAGLE-3 head's draft work, at every batch and k, and the replay figures with its cost.
    head = steps["eagle3_head"]
    assert "error" not in head, head
    assert head["head"]["draft_vocab_size"] < head["head"]["vocab_size"]  # a draft vocabulary mapped by d2t
    assert all(head[f"batch_{b}"][f"k{k}"]["head_draft_s"] > 0 for b in (1, 4, 16) for k in (1, 2, 4, 8)), head
    for a in (0, 50, 75, 80, 100):
        row = replay[f"acceptance_{a}"]
        assert row["s_per_token_with_head"] > row["s_per_token"] > 0, row


def test_speculation_client_part(tmp_path):
    """Speculative decoding at the client, small: a daemon with prompt lookup against one
    without on the preset's predictable checkpoint, time per token at batch 1 for each
    corruption of the copied continuation (the acceptance length it gives measured by the
    daemon's counters), and 32 streams; both daemons gave the target's own tokens."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "hybridd.bench", "--out", str(tmp_path / "out"), "--device", "cpu", "--preset", "tiny",
         "--quick", "--checkpoint-dir", str(tmp_path / "ckpt"), "--parts", "speculation_client",
         "--budget-s", str(int(on_this_host(200)))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=on_this_host(300),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert r["meta"]["errors"] == {}, r["meta"]["errors"]
    sc = r["speculation_client"]
    assert sc["policy"] == {"num_speculative_tokens": 4, "speculative_adaptive": True, "tokens": 16, "reps": 2}
    assert sc["plain"]["speculation"] == {"drafter": "none"} and sc["ngram"]["speculation"]["drafter"] == "ngram"
    rows = sc["rows"]
    assert [row["corruption"] for row in rows] == [0.0, 0.1, 0.2, 0.3, 0.5, 1.0]
    assert all(row["same_tokens"] and row["plain_follows_target"] and row["over_plain"] > 0 for row in rows), rows
    # An intact copy is drafted and kept; random drafts are not.
    assert sc["ngram"]["corruption_0"]["drafts"] > 0 and rows[0]["mean_acceptance_length"] > 2, rows
    assert rows[-1]["mean_acceptance_length"] < 1.5, rows
    for name in ("plain", "ngram"):
        assert len(sc[name]["corruption_0"]["samples_s"]) == 2 and sc[name]["streams"]["tokens"] == 32 * 16
    assert sc["streams_ratio"] > 0
    names = [t["target"] for t in r["targets"] if t["target"].startswith("speculation at the client")]
    assert len(names) == 3 and all(t["value"] is not None for t in r["targets"] if t["target"] in names)
    assert "speculation at the client, batch 1, ngram k=4" in (tmp_path / "out" / "bench_table.txt").read_text()
