"""Draw the plot of docs/performance.md: batch-1 time per token, one panel per GPU and model.

    python docs/performance_plot.py RUN.json [RUN.json ...] --png docs/performance.png

Each RUN.json is a `bench.json` written by `hybridd bench` (one GPU, one model
shape). A panel shows, as horizontal bars, the inter-token latency (p50, at the client)
of hybridd and of the peers measured in the same run, the decode floor of that card (the
weights' bytes over its measured copy bandwidth) as a dashed line, and, on the panel
whose card and model match, the peers' published figures in another colour. Published
figures cannot be measured here; each one below carries its source, model and GPU, and
docs/performance.md quotes the same table.

Needs matplotlib (the `dev` extra); hybridd itself does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

MEASURED = (("hybridd", "hybridd", "#1f4e9c"), ("hf_static", "HF static cache + compile", "#8a8a8a"),
            ("hf_eager", "HF eager", "#b5b5b5"))
PUBLISHED_COLOR = "#e08a1e"


@dataclass(frozen=True)
class Published:
    """A peer's figure from its own publication: batch 1, milliseconds per output token."""

    label: str
    ms_per_token: float
    gpu: str
    model: str
    source: str


# Each is the source's own figure (tokens/s converted to ms per token where it gave
# tokens/s). Llama-3.1-8B has the Llama-3-8B shape, so they stand on that panel.
PUBLISHED = (
    Published("SGLang bf16 (published)", 1e3 / 158.34, "H100", "Llama-3.1-8B-Instruct, MT-bench",
              "docs.sglang.ai, Speculative decoding, 'Performance highlights'"),
    Published("SGLang + EAGLE-3 (published)", 1e3 / 373.25, "H100", "Llama-3.1-8B-Instruct, MT-bench",
              "docs.sglang.ai, Speculative decoding, 'Performance highlights'"),
    Published("vLLM bf16 (published)", 7.07, "H100", "Llama-3.1-8B-Instruct, MT-bench",
              "vLLM EAGLE benchmark tracking, github.com/vllm-project/vllm/issues/17812"),
    Published("vLLM + EAGLE-3 (published)", 4.05, "H100", "Llama-3.1-8B-Instruct, MT-bench, k = 4",
              "vLLM EAGLE benchmark tracking, github.com/vllm-project/vllm/issues/17812"),
    Published("torchao bf16 (published)", 1e3 / 126.9, "H100", "Llama-3.1-8B",
              "github.com/pytorch/ao, torchao/quantization/README.md, float8 benchmarks"),
    Published("torchao FP8 weights (published)", 1e3 / 178.5, "H100", "Llama-3.1-8B",
              "github.com/pytorch/ao, torchao/quantization/README.md, float8 benchmarks"),
)


class NotABenchResult(ValueError):
    """A file given to the plot that is not a bench.json; the message names the file."""


def load(path: Path) -> dict:
    try:
        results = json.loads(path.read_text())
    except OSError as exc:
        raise NotABenchResult(f"{path}: cannot read it ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise NotABenchResult(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from exc
    if not isinstance(results, dict):
        raise NotABenchResult(f"{path}: expected a JSON object written by `hybridd bench`")
    missing = [key for key in ("meta", "device", "floors", "hybridd") if key not in results]
    if missing:
        raise NotABenchResult(f"{path}: not a bench result of `hybridd bench` (no {', '.join(missing)})")
    return results


def gpu_name(results: dict) -> str:
    name = str(results["device"].get("name", "?"))
    return next((short for short in ("H100", "H200", "A100", "L40S") if short in name), name)


def model_name(results: dict) -> str:
    return str(results["meta"].get("shape") or Path(str(results["meta"].get("model", "?"))).name).split(" shape")[0]


def bars(results: dict) -> list[tuple[str, float, str]]:
    """(label, ms per token, colour) of one panel, fastest first."""
    rows = [(label, results[key]["itl"]["p50_s"] * 1e3, color)
            for key, label, color in MEASURED if (results.get(key) or {}).get("itl")]
    if gpu_name(results) == "H100" and model_name(results) == "Llama-3-8B":
        rows += [(p.label, p.ms_per_token, PUBLISHED_COLOR) for p in PUBLISHED]
    return sorted(rows, key=lambda row: row[1])


def draw(runs: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=lambda r: (gpu_name(r), model_name(r)))
    heights = [len(bars(r)) + 1.2 for r in runs]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 0.4 * sum(heights) + 1.4), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    # The scale is set by the fast engines; a slower bar is cut at the edge with its value written in,
    # so that HF eager's tens of milliseconds do not squash the differences that matter.
    edge = 1.75 * max(max(ms for label, ms, _ in bars(r) if label == "hybridd") for r in runs)
    for ax, results in zip(axes[:, 0], runs):
        rows = bars(results)
        ys = list(range(len(rows)))
        ax.barh(ys, [min(ms, edge) for _, ms, _ in rows], color=[c for _, _, c in rows], height=0.7)
        ax.set_yticks(ys, [label for label, _, _ in rows])
        for y, (_, ms, _) in zip(ys, rows):
            if ms > edge:
                ax.text(edge * 0.99, y, f"{ms:.1f} ms, cut", va="center", ha="right", fontsize=8, color="white",
                        fontweight="bold")
            else:
                ax.text(ms + edge * 0.01, y, f"{ms:.2f}", va="center", fontsize=8)
        floor = results["floors"]["decode_floor_s"] * 1e3
        ax.axvline(floor, color="k", linestyle="--", linewidth=1)
        ax.set_ylim(len(rows) + 0.2, -0.6)
        ax.text(floor, len(rows) - 0.1, f" floor {floor:.2f}", fontsize=8, va="center")
        date = str(results["meta"].get("date", "?")).split(" ")[0]
        ax.set_title(f"{gpu_name(results)}, {model_name(results)} shape, bf16 weights (run of {date})", fontsize=10,
                     loc="left")
        ax.set_xlim(0, edge)
        ax.tick_params(axis="y", labelsize=9)
    axes[-1, 0].set_xlabel("milliseconds per output token at batch 1 (lower is faster); dashed: the card's floor")
    fig.suptitle("One stream's time per token: hybridd (blue), peers in the same run (grey),\n"
                 "peers' published figures (orange; FP8 and EAGLE-3 read fewer bytes or emit more tokens per read)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench.json files of `hybridd bench`")
    parser.add_argument("--png", type=Path, required=True, help="where to write the plot")
    args = parser.parse_args(argv)
    try:
        runs = [load(path) for path in args.runs]
    except NotABenchResult as exc:
        print(f"performance_plot: {exc}", file=sys.stderr)
        return 2
    draw(runs, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
