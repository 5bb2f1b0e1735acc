"""The report: the comparison table's rows and the BENCHMARKS.md targets in bench.json
(build_report), the table printed and written as bench_table.txt (render_table), and their
formatting.
"""

from __future__ import annotations

from typing import Any

from hybridd.bench.plan import BESIDE_TTFT_LENGTHS, FP8_STREAMS, SPEC_STREAMS, TTFT_LENGTHS, VARIANTS
from hybridd.bench.timing import ratio

GiB = 1 << 30


def dig(d: Any, *keys) -> Any:
    """d[k1][k2]... of nested results, or None where a part did not run or a key is missing."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def build_report(results: dict) -> tuple[list[dict], list[dict]]:
    """Rows of the comparison table and the BENCHMARKS.md targets, from the results."""
    fl = results.get("floors", {})
    hy, he, hfe, hfs = (results.get(k, {}) for k in ("hybridd", "hybridd_eager", "hf_eager", "hf_static"))
    rows = []

    def row(name, unit, key_fn, floor=None):
        values = {k: key_fn(v) for k, v in (("hybridd", hy), ("hybridd_eager", he), ("hf_eager", hfe),
                                             ("hf_static", hfs))}
        h = values["hybridd"]
        rows.append({"figure": name, "unit": unit, **values, "floor": floor, "x_floor": ratio(h, floor),
                     "hybridd_over_hybridd_eager": ratio(h, values["hybridd_eager"]),
                     "hybridd_over_hf_eager": ratio(h, values["hf_eager"]),
                     "hybridd_over_hf_static": ratio(h, values["hf_static"])})

    for n in TTFT_LENGTHS:
        row(f"TTFT {n} tok", "s", lambda r, n=n: dig(r, "ttft_s", str(n), "median_s"),
            dig(fl, "prefill_floor_s", str(n)))
    row("ITL p50 (b=1)", "s", lambda r: dig(r, "itl", "p50_s"), fl.get("decode_floor_s"))
    row("ITL p99 (b=1)", "s", lambda r: dig(r, "itl", "p99_s"), fl.get("decode_floor_s"))
    row("ITL p99/p50", "", lambda r: dig(r, "itl", "p99_over_p50"))

    targets = []

    def target(name, goal, value, limit):
        targets.append({"target": name, "goal": goal, "value": value, "limit": limit,
                        "met": None if value is None or limit is None else bool(value <= limit)})

    decode_floor = fl.get("decode_floor_s")
    bd = results.get("breakdown", {})
    target("decode GPU step, batch 1, context 512, steps back to back (x weights floor)", "<= 1.15 x floor",
           ratio(dig(bd, "decode_b1", "step_s"), decode_floor), 1.15)
    p50 = dig(hy, "itl", "p50_s")
    target("decode ITL p50, batch 1", "<= 1.20 x floor", ratio(p50, decode_floor), 1.20)
    target("decode ITL p50, batch 1 (stretch)", "<= 1.15 x floor", ratio(p50, decode_floor), 1.15)
    target("decode ITL p99/p50, batch 1", "<= 1.05", dig(hy, "itl", "p99_over_p50"), 1.05)

    def worst_ttft(key: str) -> float | None:
        worst = [ratio(dig(hy, key, str(n), "median_s"), dig(fl, "prefill_floor_s", str(n))) for n in TTFT_LENGTHS]
        return max(worst) if worst and None not in worst else None

    target("TTFT at the client 10-500 tokens (worst length)", "<= 1.5 x prefill floor", worst_ttft("ttft_s"), 1.5)
    target("TTFT at the client 10-500 tokens (worst length, stretch)", "<= 1.3 x prefill floor",
           worst_ttft("ttft_s"), 1.3)
    b32 = bd.get("decode_b32") or {}
    tput = dig(hy, "concurrency", "32", "decode_tokens_per_s")
    target(f"decode GPU step, batch 32, context 512, steps back to back (x (weights + KV) floor; 32 streams: "
           f"{fmt(tput, 1, 0)} decode tokens/s)", "<= 1.20 x floor",
           ratio(b32.get("step_s"), b32.get("weights_kv_floor_s")), 1.20)
    ce = results.get("capture_evict") or {}
    if ce.get("p99_ratio") is not None:
        target(f"ITL p99 during forced prefill capture / steady ({ce.get('captures_during_decode')} captures "
               f"during decode)", "<= 1.10", ce["p99_ratio"], 1.10)
    else:
        bc = hy.get("background_capture") or {}
        target(f"ITL p99 during background capture / steady ({bc.get('basis', '-')})", "<= 1.10",
               bc.get("p99_ratio") if bc.get("p99_ratio") is not None else bc.get("early_p99_ratio"), 1.10)
    mem = [v for v in (dig(hy, "graph_memory", "graph_bytes"), dig(hy, "graph_memory", "graph_pool_bytes")) if v]
    target("all graphs' memory (GiB, larger of measured and pool)", "<= 1 GiB", max(mem) / GiB if mem else None, 1.0)
    target(f"start to ready after weights are loaded (s; {cache_state(hy.get('startup') or {})})", "<= 20 s",
           dig(hy, "startup", "after_weights_to_ready_s"), 20.0)
    bd8 = results.get("breakdown_fp8") or {}
    if bd8:
        fp8_floor = ratio(bd8.get("weight_bytes"), dig(results, "device", "copy_bandwidth_Bps"))
        target("FP8 decode GPU step, batch 1, context 512 (x FP8 weights floor: FP8 projections, bf16 embedding and "
               "LM head)", "<= 1.15 x floor", ratio(dig(bd8, "decode_b1", "step_s"), fp8_floor), 1.15)
        target("FP8 decode GPU step, batch 32, context 512 (x (FP8 weights + KV) floor)", "<= 1.20 x floor",
               ratio(dig(bd8, "decode_b32", "step_s"), dig(bd8, "decode_b32", "weights_kv_floor_s")), 1.20)
    f8 = results.get("fp8") or {}
    if f8.get("fp8_over_bf16"):
        over = f8["fp8_over_bf16"]
        target("FP8 / bf16 ITL p50, batch 1", "<= 0.62", over.get("itl_p50"), 0.62)
        ttfts = [over.get(f"ttft_{n}") for n in f8.get("ttft_lengths", [])]
        worst = max(ttfts) if ttfts and None not in ttfts else None
        target(f"FP8 / bf16 TTFT at {'-'.join(str(n) for n in f8.get('ttft_lengths', []))} tokens (worst length)",
               "<= 0.75", worst, 0.75)
        target(f"FP8 start to ready after weights are loaded (s; {cache_state(dig(f8, 'fp8', 'startup') or {})})",
               "<= 20 s", dig(f8, "fp8", "startup", "after_weights_to_ready_s"), 20.0)
    sc = results.get("speculation_client") or {}
    if sc.get("rows"):
        near3 = min(sc["rows"], key=lambda r: abs((r["mean_acceptance_length"] or 0) - 3))
        target(f"speculation at the client, batch 1: time per token / plain at mean acceptance length "
               f"{fmt(near3['mean_acceptance_length'])} (nearest 3)", "<= 0.40", near3["over_plain"], 0.40)
        last = sc["rows"][-1]
        target(f"speculation at the client, batch 1: time per token / plain, all drafts random (mean acceptance "
               f"length {fmt(last['mean_acceptance_length'])})", "<= 1.10", last["over_plain"], 1.10)
        target(f"speculation at the client, {SPEC_STREAMS} streams: tokens/s plain / ngram", "<= 1.00",
               ratio(*(dig(sc, n, "streams", "tokens_per_s") for n in ("plain", "ngram"))), 1.0)
    if hy.get("gateway"):
        added = dig(hy, "gateway", "added_ttft_p50_s")
        target("HTTP gateway: TTFT p50 added vs the SDK over its socket (ms)", "<= 0.3 ms",
               None if added is None else added * 1e3, 0.3)
        added = dig(hy, "gateway", "added_itl_p50_s")
        target("HTTP gateway: ITL p50 added vs the SDK over its socket (ms)", "<= 0.1 ms",
               None if added is None else added * 1e3, 0.1)
    return rows, targets


def cache_state(startup: dict) -> str:
    """Which compile caches the start found empty ("Triton cache cold, Inductor cache
    warm"): a Triton cache left by an earlier part (the breakdown compiles the kernels)
    spares the start most of its compiling, an empty one is a first start on the host."""
    files = startup.get("compile_cache_files_at_spawn")
    if not files:
        return "caches unknown"
    return ", ".join(f"{name.capitalize()} cache {'warm' if n else 'cold'}" for name, n in files.items())


def fmt(v: Any, scale: float = 1.0, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    return f"{v * scale:.{digits}f}"


def render_table(results: dict) -> str:
    rows, targets = results["table"], results["targets"]
    meta, fl, dev = results["meta"], results.get("floors", {}), results.get("device", {})
    lines = [f"hybridd bench {meta['date']}  {dev.get('name', '?')}  {meta.get('shape') or meta.get('model')}  "
             f"client: {meta.get('client', '-')}  code: {meta.get('git') or '-'}, "
             f"sources {meta.get('source_sha256', '-')}"]
    if dev:
        lines.append(f"copy bw {fmt(dev.get('copy_bandwidth_Bps'), 1e-12)} TB/s  {dev.get('matmul_dtype')} matmul "
                     f"{fmt(dev.get('matmul_flops'), 1e-12, 1)} TFLOP/s  "
                     f"weights {fmt(fl.get('weight_bytes'), 1e-9)} GB  "
                     f"decode floor {fmt(fl.get('decode_floor_s'), 1e3)} ms")
    # (title, key, width, in the row's unit (else a ratio)) of each column after the figure's name.
    columns = (("hybridd", "hybridd", 8, True), ("floor", "floor", 7, True), ("x floor", "x_floor", 7, False),
               ("hyb-eager", "hybridd_eager", 9, True), ("HF eager", "hf_eager", 8, True),
               ("HF static", "hf_static", 9, True), ("/hyb-eag", "hybridd_over_hybridd_eager", 8, False),
               ("/HF-eag", "hybridd_over_hf_eager", 7, False), ("/HF-stat", "hybridd_over_hf_static", 8, False))
    head = f"{'figure (ms)':18s} | " + " | ".join(f"{title:>{width}s}" for title, _, width, _ in columns)
    lines += ["", head, "-" * len(head)]
    for r in rows:
        s = 1e3 if r["unit"] == "s" else 1.0
        lines.append(f"{r['figure']:18s} | " + " | ".join(f"{fmt(r[key], s if scaled else 1.0):>{width}s}"
                                                           for _, key, width, scaled in columns))
    hy = results.get("hybridd", {})
    conc = hy.get("concurrency")
    if conc:
        lines += ["", "streams | tokens/s | decode tok/s | ITL p50 ms | ITL p99 ms | p99/p50 | TTFT med ms"]
        for n, c in conc.items():
            lines.append(f"{n:>7s} | {fmt(c['tokens_per_s'], 1, 0):>8s} | {fmt(c['decode_tokens_per_s'], 1, 0):>12s} | "
                         f"{fmt(c['itl_p50_s'], 1e3):>10s} | {fmt(c['itl_p99_s'], 1e3):>10s} | "
                         f"{fmt(ratio(c['itl_p99_s'], c['itl_p50_s'])):>7s} | {fmt(c['ttft_median_s'], 1e3):>11s}")
    bc = hy.get("background_capture")
    if bc:
        def p(key):
            return f"{fmt(dig(bc, key, 'p50_s'), 1e3)}/{fmt(dig(bc, key, 'p99_s'), 1e3)} ms (n={dig(bc, key, 'n')})"

        lines.append("")
        lines.append(f"ITL p50/p99 during prefill capture {p('during')}, first {bc.get('early_s')} s after ready "
                     f"{p('early')}, steady {p('steady')}")
        lines.append(f"  capture window {fmt(bc.get('capture_window_s'))} s ({bc.get('prefill_buckets_captured')}/"
                     f"{bc.get('prefill_buckets')} prefill buckets); first request after ready: TTFT "
                     f"{fmt(bc.get('first_request_ttft_s'), 1e3)} ms, first token "
                     f"{fmt(bc.get('first_token_after_capture_start_s'))} s after capture began")
        if bc.get("note"):
            lines.append(f"  note: {bc['note']}")
    for name in ("hybridd", "hybridd_eager", *VARIANTS):
        st = dig(results, name, "startup")
        if st:
            lines.append(f"{name} start: spawn->ready {fmt(st['spawn_to_ready_s'])} s (imports "
                         f"{fmt(st['interpreter_and_imports_s'])} s, weights {fmt(st['weights_load_s'])} s, "
                         f"after weights -> ready {fmt(st['after_weights_to_ready_s'])} s; "
                         f"{cache_state(st)})")
            ahead = next((p["detail"] for p in st.get("phases", []) if p["detail"].startswith("compiled ")), None)
            if ahead:
                lines.append(f"  kernels compiled ahead: {ahead}")
    gm = hy.get("graph_memory")
    if gm:
        per = ", ".join(f"{b['kind'][0]}{b['size']}:{fmt(b['bytes'], 2**-20, 0)}"
                        for b in gm["buckets"] if b["captured"])
        lines.append(f"graph memory: measured {fmt(gm['graph_bytes'], 2**-20, 1)} MiB, pool "
                     f"{fmt(gm['graph_pool_bytes'], 2**-20, 1)} MiB; per bucket MiB {per}")
    from hybridd.bench.breakdown import render as render_breakdown

    bd, bd8 = results.get("breakdown"), results.get("breakdown_fp8")
    if bd:
        lines += ["", f"where the step goes ({dig(bd, 'decode_b1', 'source') or '-'}; each category against its own "
                      f"floor: bytes / copy bandwidth or FLOPs / matmul rate)", *render_breakdown(bd)]
    if bd8:
        lines += ["", f"where the FP8 model's step goes (weights {fmt(bd8.get('weight_bytes'), 1e-9)} GB; GEMM floors "
                      f"on the FP8 bytes)", *render_breakdown(bd8)]
    f8 = results.get("fp8") or {}
    if f8.get("fp8_over_bf16"):
        lines += ["", f"{'FP8 against bf16 (ms)':26s} | {'bf16':>8s} | {'fp8':>8s} | {'fp8/bf16':>8s}"]
        figures = [(f"TTFT {n} tok", ("ttft_s", str(n), "median_s"), f"ttft_{n}") for n in f8.get("ttft_lengths", [])]
        figures += [("ITL p50 (b=1)", ("itl", "p50_s"), "itl_p50"), ("ITL p99 (b=1)", ("itl", "p99_s"), "itl_p99"),
                    ("after weights to ready", ("startup", "after_weights_to_ready_s"), "after_weights_to_ready")]
        for label, keys, over in figures:
            lines.append(f"{label:26s} | {fmt(dig(f8, 'bf16', *keys), 1e3):>8s} | "
                         f"{fmt(dig(f8, 'fp8', *keys), 1e3):>8s} | "
                         f"{fmt(f8['fp8_over_bf16'].get(over)):>8s}")
        streams = [fmt(dig(f8, dtype, "concurrency", str(FP8_STREAMS), "decode_tokens_per_s"), 1, 0)
                   for dtype in ("bf16", "fp8")]
        lines.append(f"{f'{FP8_STREAMS} streams (decode tok/s)':26s} | {streams[0]:>8s} | {streams[1]:>8s} | "
                     f"{fmt(f8['fp8_over_bf16'].get(f'decode_tokens_per_s_{FP8_STREAMS}')):>8s}")
    if f8.get("fp8_kv_over_fp8"):
        over = f8["fp8_kv_over_fp8"]
        lines += ["", f"{'FP8 KV cache (ms)':26s} | {'fp8':>8s} | {'fp8+kv':>8s} | {'kv/fp8':>8s}"]
        for label, keys, name in (("ITL p50 (b=1)", ("itl", "p50_s"), "itl_p50"),
                                  ("ITL p99 (b=1)", ("itl", "p99_s"), "itl_p99")):
            ours, theirs = fmt(dig(f8, "fp8", *keys), 1e3), fmt(dig(f8, "fp8_kv", *keys), 1e3)
            lines.append(f"{label:26s} | {ours:>8s} | {theirs:>8s} | {fmt(over.get(name)):>8s}")
        streams = [fmt(dig(f8, name, "concurrency", str(FP8_STREAMS), "decode_tokens_per_s"), 1, 0)
                   for name in ("fp8", "fp8_kv")]
        lines.append(f"{f'{FP8_STREAMS} streams (decode tok/s)':26s} | {streams[0]:>8s} | {streams[1]:>8s} | "
                     f"{fmt(over.get(f'decode_tokens_per_s_{FP8_STREAMS}')):>8s}")
        blocks = [fmt(dig(f8, name, "kv_blocks"), 1, 0) for name in ("fp8", "fp8_kv")]
        lines.append(f"{'KV blocks':26s} | {blocks[0]:>8s} | {blocks[1]:>8s} |")
    sc = results.get("speculation_client") or {}
    if sc.get("rows"):
        pol = sc.get("policy", {})
        lines += ["", f"speculation at the client, batch 1, ngram k={pol.get('num_speculative_tokens')} adaptive "
                      f"{pol.get('speculative_adaptive')}:",
                  "corrupted | accept len | plain ms | ngram ms | /plain | same tokens"]
        for row in sc["rows"]:
            key = f"corruption_{round(row['corruption'] * 100)}"
            lines.append(f"{row['corruption']:>9.2f} | {fmt(row['mean_acceptance_length']):>10s} | "
                         f"{fmt(dig(sc, 'plain', key, 's_per_token'), 1e3, 3):>8s} | "
                         f"{fmt(dig(sc, 'ngram', key, 's_per_token'), 1e3, 3):>8s} | "
                         f"{fmt(row['over_plain'], 1, 3):>6s} | "
                         f"{row['same_tokens'] and row['plain_follows_target']}")
        lines.append(f"{SPEC_STREAMS} streams tokens/s: "
                     f"plain {fmt(dig(sc, 'plain', 'streams', 'tokens_per_s'), 1, 0)}, "
                     f"ngram {fmt(dig(sc, 'ngram', 'streams', 'tokens_per_s'), 1, 0)} "
                     f"(x{fmt(sc.get('streams_ratio'), 1, 3)})")
    for name, (_, what, _) in VARIANTS.items():
        vs = dig(results, name, "vs_off")
        if vs:
            lines.append(f"{what} vs the default (client, batch 1): ITL p50 {fmt(vs['itl_p50_on_s'], 1e3, 3)} vs "
                         f"{fmt(vs['itl_p50_off_s'], 1e3, 3)} ms (x{fmt(vs['itl_p50_ratio'], 1, 3)}), ITL p99 "
                         f"{fmt(vs['itl_p99_on_s'], 1e3, 3)} vs {fmt(vs['itl_p99_off_s'], 1e3, 3)} ms; " + ", ".join(
                             f"TTFT {n} tok {fmt(vs[f'ttft_{n}_on_s'], 1e3, 3)} "
                             f"vs {fmt(vs[f'ttft_{n}_off_s'], 1e3, 3)} "
                             f"ms (x{fmt(vs[f'ttft_{n}_ratio'], 1, 3)})" for n in BESIDE_TTFT_LENGTHS))
    ce = results.get("capture_evict")
    if ce:
        lines.append(f"ITL p50/p99 during forced prefill capture {fmt(dig(ce, 'during', 'p50_s'), 1e3)}/"
                     f"{fmt(dig(ce, 'during', 'p99_s'), 1e3)} ms (n={dig(ce, 'during', 'n')}), steady "
                     f"{fmt(dig(ce, 'steady', 'p50_s'), 1e3)}/{fmt(dig(ce, 'steady', 'p99_s'), 1e3)} ms "
                     f"(n={dig(ce, 'steady', 'n')}): p99 x{fmt(ce.get('p99_ratio'), 1, 3)}; "
                     f"{ce.get('captures_during_decode')} captures, {ce.get('evictions')} evictions, buckets "
                     f"{dig(ce, 'plan', 'x')}/{dig(ce, 'plan', 'y')} "
                     f"under a {dig(ce, 'config', 'graph_memory_budget_mb')} MiB budget")
        if ce.get("longest_during_gaps"):
            lines.append("  longest gaps during captures: " + "; ".join(
                f"{fmt(x['gap_s'], 1e3)} ms from {fmt(x['after_first_token_s'], 1e3)} ms after the trigger's first "
                f"token (bucket {x['bucket']}, capture {fmt(x['capture_s'], 1e3)} ms)"
                for x in ce["longest_during_gaps"]))
        if ce.get("note"):
            lines.append(f"  note: {ce['note']}")
    gw = hy.get("gateway")
    if gw:
        lines.append(f"HTTP gateway vs SDK over its socket: TTFT p50 {fmt(dig(gw, 'http', 'ttft_p50_s'), 1e3, 3)} vs "
                     f"{fmt(dig(gw, 'sdk', 'ttft_p50_s'), 1e3, 3)} ms (+{fmt(gw.get('added_ttft_p50_s'), 1e3, 3)}), "
                     f"ITL p50 {fmt(dig(gw, 'http', 'itl_p50_s'), 1e3, 3)} "
                     f"vs {fmt(dig(gw, 'sdk', 'itl_p50_s'), 1e3, 3)} "
                     f"ms (+{fmt(gw.get('added_itl_p50_s'), 1e3, 3)})")
    hs = results.get("hf_static", {})
    if hs.get("warmup_s") is not None:
        lines.append(f"HF static warm-up (compile) {fmt(hs['warmup_s'], 1, 1)} s: {hs.get('compile')}")
    lines += ["", "targets (BENCHMARKS.md):"]
    lines += [f"  [{ {True: 'MET ', False: 'MISS', None: 'n/a '}[t['met']]}] {t['target']}: {fmt(t['value'], 1, 3)} "
              f"(goal {t['goal']})" for t in targets]
    if meta.get("skipped"):
        lines += ["", "skipped: " + "; ".join(f"{k} ({v})" for k, v in meta["skipped"].items())]
    if meta.get("errors"):
        lines += ["errors: " + "; ".join(f"{k}: {v.splitlines()[-1] if v else v}" for k, v in meta["errors"].items())]
    lines += [f"note: {note}" for note in meta.get("notes", [])]
    lines.append("parts (s): " + ", ".join(f"{k} {v:.1f}" for k, v in meta["part_s"].items())
                 + f"; total {meta.get('total_s', 0):.1f}")
    return "\n".join(lines)
