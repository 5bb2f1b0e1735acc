"""Plot the results of `hybridd bench` for a reader: one row of panels per model shape.

    python docs/lab/benchmarks_plot.py OUT/llama2-7b/bench.json [OUT/llama3-8b/bench.json ...] \\
        [--png docs/lab/benchmarks.png] [--theirs paper.json]

Runs where matplotlib is installed (a dev tool, not a runtime dependency of hybridd);
the GPU machine only has to produce bench.json. Every axis is linear, in milliseconds
or tokens per second; floors are drawn as black lines. Panels, left to right:

1. TTFT at the client (median) at each prompt length: hybridd beside each peer
   (hybridd with graphs off, transformers eager, transformers static cache +
   torch.compile), the prefill floor as a line over each group.
2. ITL at batch 1: p50 bars and p99 ticks for hybridd through each client the bench
   measured (SDK, raw client, reply ring) and each peer, the decode floor; the axis is
   hybridd's scale, and a peer's bar past it is cut at the top with its value written in.
3. hybridd at 1-32 concurrent streams: aggregate decode tokens/s (bars) and ITL
   p50/p99 (lines, right axis) with the decode floor.
4. Where a step goes (when the bench ran its breakdown): GPU time per kernel category,
   stacked, beside the same categories' floors, for decode at batch 1 and 32 and the
   16- and 128-token prefills. A profile whose kernel times overlap (programmatic dependent
   launch, recorded before the bench charged each kernel only the time it adds) shows
   the GPU step alone.

Published figures of others may stand beside ours only labelled as theirs: `--theirs`
takes a JSON file `{"label": "...", "source": "...", "ttft_ms": {"10": 12.3, ...}}`
(nothing is built in: no number here is invented).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SERIES = (("hybridd", "hybridd", "C0"), ("hybridd_eager", "hybridd, graphs off", "C1"),
          ("hf_eager", "HF generate, eager", "C2"), ("hf_static", "HF generate, static + compile", "C3"))
SHAPES = {"llama2-7b": "Llama-2-7B", "llama3-8b": "Llama-3-8B", "llama-1b": "Llama-1B"}
CATEGORY_COLORS = {"gemm.qkv": "#1f77b4", "gemm.o": "#4a90c8", "gemm.gate_up": "#7fb2dd", "gemm.down": "#aecde9",
                   "gemm.lm_head": "#d4e4f3", "gemm": "#1f77b4", "attention": "#d62728", "norm": "#2ca02c",
                   "rope_kv": "#9467bd", "other": "#8c564b", "gaps": "#bbbbbb"}


def model_name(results: dict) -> str:
    """The model by its shape, as the bench names it; older results by their preset."""
    meta = results.get("meta", {})
    if meta.get("shape"):
        return meta["shape"]
    dtype = "bf16" if meta.get("device") == "cuda" else "float32"
    preset = meta.get("preset")
    if preset in SHAPES and "random" in str(meta.get("model", "")):
        return f"{SHAPES[preset]} shape, random {dtype} weights"
    return f"{Path(str(meta.get('model', '?'))).name} ({dtype})"


def present(results: dict) -> list[tuple[str, str, str]]:
    return [s for s in SERIES if results.get(s[0])]


def ttft_panel(ax, results: dict, theirs: dict | None) -> None:
    series = present(results)
    lengths = sorted({int(n) for key, _, _ in series for n in (results[key].get("ttft_s") or {})})
    if not lengths:
        ax.set_axis_off()
        return
    width = 0.8 / max(1, len(series))
    floors = (results.get("floors") or {}).get("prefill_floor_s") or {}
    for j, (key, label, color) in enumerate(series):
        ttft = results[key].get("ttft_s") or {}
        xs = [i + (j - (len(series) - 1) / 2) * width for i, n in enumerate(lengths)]
        ys = [(ttft.get(str(n)) or {}).get("median_s") for n in lengths]
        ax.bar([x for x, y in zip(xs, ys) if y is not None], [y * 1e3 for y in ys if y is not None], width,
               color=color, label=label)
    for i, n in enumerate(lengths):
        if floors.get(str(n)) is not None:
            ax.hlines(floors[str(n)] * 1e3, i - 0.45, i + 0.45, color="k", linewidth=2,
                      label="prefill floor" if i == 0 else None)
    if theirs and theirs.get("ttft_ms"):
        pts = [(lengths.index(int(n)), float(v)) for n, v in theirs["ttft_ms"].items() if int(n) in lengths]
        if pts:
            ax.plot(*zip(*sorted(pts)), color="grey", marker="x", linestyle="none",
                    label=f"{theirs.get('label', 'published')} (theirs, not measured here)")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT at the client, median (ms)")
    ax.set_title("Time to first token, batch 1")
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


# hybridd's batch-1 ITL through each client the bench measured it with, in its order.
HYBRIDD_CLIENTS = (("itl", "SDK"), ("itl_raw_client", "raw client"), ("itl_polling_client", "raw client,\npolling"),
                   ("itl_ring", "SDK,\nreply ring"), ("itl_ring_sleep", "SDK, reply\nring asleep"),
                   ("itl_ring_paced", "SDK, reply\nring paced"))


def itl_bars(results: dict) -> list[tuple[str, dict, str, bool]]:
    """(label, ITL figures, colour, sets the scale) for every client of hybridd and every
    peer the run measured; hybridd's clients set the axis, its graphs-off run does not."""
    bars = []
    hybridd = results.get("hybridd") or {}
    for key, client in HYBRIDD_CLIENTS:
        if (hybridd.get(key) or {}).get("p50_s") is not None:
            bars.append((f"hybridd\n{client}", hybridd[key], "C0", True))
    for key, label, color in present(results):
        itl = results[key].get("itl") or {}
        if key != "hybridd" and itl.get("p50_s") is not None:
            bars.append((label.replace(", ", "\n"), itl, color, False))
    return bars


def itl_panel(ax, results: dict) -> None:
    bars = itl_bars(results)
    if not bars:
        ax.set_axis_off()
        return
    floor = (results.get("floors") or {}).get("decode_floor_s")
    # The axis is hybridd's scale: a peer ten times slower would flatten every hybridd bar,
    # so bars past the top are cut there and carry their value.
    ours = [itl.get("p99_s") or itl["p50_s"] for _, itl, _, mine in bars if mine] + ([floor] if floor else [])
    top = 1.35 * max(ours) * 1e3 if ours else float("inf")
    for i, (label, itl, color, _) in enumerate(bars):
        p50, p99 = itl["p50_s"] * 1e3, (itl.get("p99_s") or 0) * 1e3
        ax.bar(i, min(p50, top), 0.6, color=color)
        if p50 > top:
            # Short lines: with every client measured a bar is narrow.
            ax.text(i, top, f"{p50:.1f} ms\np99 {p99:.0f}\nabove\nthe axis", ha="center", va="top", fontsize=6,
                    color="white", fontweight="bold")
            continue
        ratio = f"\n{p50 / (floor * 1e3):.2f}x\nfloor" if floor else ""
        ax.text(i, p50 * 0.5, f"{p50:.2f}{ratio}", ha="center", va="center", fontsize=6, color="white")
        if p99:
            tick = min(p99, top)
            ax.hlines(tick, i - 0.3, i + 0.3, color="k", linestyle="--", label="p99" if i == 0 else None)
            ax.text(i, tick, f"{p99 / p50:.2f}x p50", ha="center", va="bottom", fontsize=6)
    if floor:
        ax.axhline(floor * 1e3, color="k", linewidth=1.5, label=f"decode floor {floor * 1e3:.2f} ms")
    ax.set_xticks(range(len(bars)), [label for label, _, _, _ in bars], fontsize=6)
    ax.set_ylabel("inter-token latency, batch 1 (ms)")
    ax.set_title("ITL at batch 1: p50 (bars) and p99 (dashes)")
    ax.set_ylim(0, top if top != float("inf") else None)
    ax.grid(True, axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right")


def streams_panel(ax, results: dict) -> None:
    conc = (results.get("hybridd") or {}).get("concurrency") or {}
    if not conc:
        ax.set_axis_off()
        return
    levels = sorted(int(n) for n in conc)
    xs = range(len(levels))
    tput = [conc[str(n)].get("decode_tokens_per_s") or conc[str(n)]["tokens_per_s"] for n in levels]
    ax.bar(xs, tput, 0.6, color="C0", alpha=0.35, label="decode tokens/s (left)")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_xticks(list(xs), [str(n) for n in levels])
    ax.set_xlabel("concurrent streams")
    right = ax.twinx()
    right.plot(xs, [conc[str(n)]["itl_p50_s"] * 1e3 for n in levels], marker="o", color="C0", label="ITL p50 (right)")
    right.plot(xs, [conc[str(n)]["itl_p99_s"] * 1e3 for n in levels], marker="o", color="C0", linestyle="--",
               label="ITL p99 (right)")
    floor = (results.get("floors") or {}).get("decode_floor_s")
    if floor:
        right.axhline(floor * 1e3, color="k", linewidth=1.5, label="decode floor, per token (right)")
    right.set_ylabel("ITL (ms)")
    right.set_ylim(bottom=0)
    ax.set_title("hybridd: throughput and ITL against streams")
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=7, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)


def breakdown_steps(results: dict) -> list[str]:
    bd = results.get("breakdown") or {}
    return [k for k in ("decode_b1", "decode_b32", "prefill_16", "prefill_128") if (bd.get(k) or {}).get("categories")]


def overlapping_steps(results: dict) -> list[str]:
    """Steps whose kernel times add up to more than their GPU time: a profile of kernels
    that overlap (programmatic dependent launch), summed by whole durations before the
    bench charged each kernel only the time it adds. Their categories are not drawn."""
    bd = results.get("breakdown") or {}
    return [k for k in breakdown_steps(results)
            if bd.get("attribution") != "exclusive" and bd[k].get("kernel_s", 0.0) > 1.02 * bd[k].get("step_s", 0.0)]


def has_breakdown(results: dict) -> bool:
    return bool(breakdown_steps(results))


def breakdown_panel(ax, results: dict) -> None:
    bd = results.get("breakdown") or {}
    steps = breakdown_steps(results)
    if not steps:
        ax.set_axis_off()
        return
    labels = {"decode_b1": "decode b=1", "decode_b32": "decode b=32", "prefill_16": "prefill 16",
              "prefill_128": "prefill 128"}
    seen: set[str] = set()
    overlapping = overlapping_steps(results)
    for i, key in enumerate(steps):
        cats = bd[key]["categories"]
        if key in overlapping:
            ax.bar(i - 0.2, bd[key]["step_s"] * 1e3, 0.38, color="#bbbbbb", edgecolor="white")
            ax.annotate("kernels overlap (PDL):\nGPU step only", (i - 0.2, bd[key]["step_s"] * 1e3), fontsize=6,
                        ha="center", va="bottom")
            cats = {name: {"floor_s": c.get("floor_s")} for name, c in cats.items()}
        for offset, field in ((-0.2, "time_s"), (0.2, "floor_s")):
            bottom = 0.0
            for name, c in cats.items():
                value = (c.get(field) or 0.0) * 1e3
                if value <= 0:
                    continue
                ax.bar(i + offset, value, 0.38, bottom=bottom, color=CATEGORY_COLORS.get(name, "#777777"),
                       edgecolor="white", linewidth=0.3, hatch="//" if field == "floor_s" else None)
                seen.add(name)
                bottom += value
    ax.set_xticks(range(len(steps)), [f"{labels[k]}\nmeasured | floor" for k in steps], fontsize=7)
    from matplotlib.patches import Patch

    handles = [Patch(color=CATEGORY_COLORS.get(n, "#777777"), label=n) for n in CATEGORY_COLORS if n in seen]
    handles.append(Patch(facecolor="white", edgecolor="k", hatch="//", label="floor (hatched)"))
    ax.set_ylabel("time per step (ms; GPU time on CUDA)")
    ax.set_title("Where a step goes, by kernel category")
    ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(handles=handles, fontsize=6, ncol=2, loc="upper left")


def plot(runs: list[dict], png: Path, theirs: dict | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The breakdown's column only where some run has one: no empty panel beside the others.
    columns = 4 if any(has_breakdown(results) for results in runs) else 3
    fig, axes = plt.subplots(len(runs), columns, figsize=(5.6 * columns, 5.2 * len(runs)), squeeze=False)
    for row, results in zip(axes, runs):
        ttft_panel(row[0], results, theirs)
        itl_panel(row[1], results)
        streams_panel(row[2], results)
        if columns == 4:
            breakdown_panel(row[3], results)
        meta = results.get("meta", {})
        device = (results.get("device") or {}).get("name", "?")
        caption = row[0].annotate(f"{model_name(results)} - {device} - {meta.get('date', '')}", (0, 1.12),
                                  xycoords="axes fraction", fontsize=10, fontweight="bold")
        caption.set_in_layout(False)  # else the layout keeps the caption's width free beside the panel
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()), h_pad=4.5)  # room for the captions
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def read_object(parser: argparse.ArgumentParser, path: Path) -> dict:
    """The JSON object in `path`; a clear error naming the file otherwise."""
    try:
        value = json.loads(path.read_text())
    except OSError as exc:
        parser.error(f"{path}: cannot read it: {exc.strerror}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        parser.error(f"{path}: not JSON: {exc}")
    if not isinstance(value, dict):
        parser.error(f"{path}: expected a JSON object as `hybridd bench` writes, got {type(value).__name__}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, nargs="+", help="bench.json files written by `hybridd bench`")
    parser.add_argument("--png", type=Path, help="output image (default: next to the first JSON, bench.png)")
    parser.add_argument("--theirs", type=Path, help="published TTFT figures of others, labelled as theirs")
    args = parser.parse_args(argv)
    runs = [read_object(parser, p) for p in args.json]
    theirs = read_object(parser, args.theirs) if args.theirs else None
    print(plot(runs, args.png or args.json[0].with_name("bench.png"), theirs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
