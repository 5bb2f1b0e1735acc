"""The context generator's detokenization cost per token: the `DecodeStream` path against
the two-decode window path, on one tokenizer, with the same chunks checked.

    python scripts/bench_detokenizer.py                       # the embedded model's tokenizer
    python scripts/bench_detokenizer.py --model /path/to/hf   # any local Hugging Face directory
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hybridd.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from hybridd.model.tokenizer import load_tokenizer  # noqa: E402


def chunks(detokenizer: IncrementalDetokenizer, output: list[int]) -> list[str]:
    """Each token's chunk, the output growing as a sequence's does."""
    so_far: list[int] = []
    out = []
    for token in output:
        so_far.append(token)
        out.append(detokenizer.add(so_far))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "hybridd" / "assets" / "tiny-shakespeare")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    text = (ROOT / "hybridd" / "assets" / "tiny-shakespeare" / "validation.txt").read_text()[:4000]
    ids = tokenizer.encode(text)
    prompt, output = ids[:16], ids[16:]

    def window() -> IncrementalDetokenizer:
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        detokenizer._stream = None  # the window path, as for a tokenizer without the stream
        return detokenizer

    paths = {"stream": lambda: IncrementalDetokenizer(tokenizer, prompt), "window": window}
    if paths["stream"]()._stream is None:
        print("this tokenizer has no DecodeStream path; only the window path runs")
        del paths["stream"]
    results = {name: chunks(make(), output) for name, make in paths.items()}
    if len(results) == 2 and "".join(results["stream"]) != "".join(results["window"]):
        raise SystemExit("the two paths gave different text")
    for name, make in paths.items():
        start = time.perf_counter()
        for _ in range(args.repeats):
            chunks(make(), output)
        per_token = (time.perf_counter() - start) / args.repeats / len(output)
        print(f"{name:6s} {per_token * 1e6:7.2f} us per token ({len(output)} tokens, {args.repeats} repeats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
