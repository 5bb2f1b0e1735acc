"""Decode and encode time per wire message: this tree's codec, optionally against a git revision's.

    python scripts/bench_protocol.py                      # this tree
    python scripts/bench_protocol.py --baseline a2d3dc8   # and protocol/ as it was at a2d3dc8

The baseline's `protocol/` is read with `git show` into a temporary package (its
`hybridd.protocol` imports rewritten), so both run in one process on the same
frames: the bytes a client or a worker sends, decoded to a validated message the
way the daemon does it (frame → checked, typed message), best of several runs.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from typing import Any, Callable

from hybridd.protocol import codec
from hybridd.protocol.control import Launched, Step
from hybridd.protocol.messages import (
    Choice,
    ChunkReply,
    FinalReply,
    GenerateRequest,
    HealthRequest,
    SamplingParams,
    Timings,
    Usage,
)

REPO = Path(__file__).resolve().parent.parent

SAMPLING = SamplingParams(max_tokens=256, temperature=0.7, top_k=40, top_p=0.9, seed=7, stop=["\n\n"])
# (name, message, family): the family is the decoder the receiving side uses.
MESSAGES: list[tuple[str, Any, str]] = [
    ("health", HealthRequest(id="h-1"), "request"),
    ("generate, text prompt", GenerateRequest(id="g-1", prompt="Once upon a time " * 8, sampling=SAMPLING), "request"),
    ("generate, 1k token ids", GenerateRequest(id="g-2", prompt_token_ids=list(range(1000)), sampling=SAMPLING), "request"),
    ("generate, 32k token ids", GenerateRequest(id="g-3", prompt_token_ids=[i % 32000 for i in range(32768)]), "request"),
    ("chunk", ChunkReply(id="g-1", index=12, text=" there", token_ids=[1234]), "reply"),
    ("final, 256 tokens", FinalReply(
        id="g-1", choices=[Choice(index=0, text="x" * 1024, token_ids=list(range(256)), finish_reason="length")],
        usage=Usage(prompt_tokens=12, completion_tokens=256), timings=Timings(ttft_s=0.012, total_s=0.9, queue_s=0.0004),
    ), "reply"),
    ("step (control)", Step(step=123456, kind="decode", n_real=5, n_tokens=5), "control"),
    ("launched (control)", Launched(step=123456), "control"),
]


def load_baseline(revision: str) -> tuple[dict[str, Callable[[bytes], Any]], Callable[[Any], bytes]]:
    """The decoders of `revision`'s protocol/, as the daemon used them (decode, then from_wire, or
    its typed decoder where it had one), and its encoder."""
    root = Path(tempfile.mkdtemp(prefix="hybridd-protocol-"))
    package = root / "baseline_protocol"
    package.mkdir()
    names = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", f"{revision}:protocol"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    for name in names:
        if name.endswith(".py"):
            source = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{revision}:protocol/{name}"],
                check=True, capture_output=True, text=True,
            ).stdout
            (package / name).write_text(source.replace("hybridd.protocol", "baseline_protocol"))
    sys.path.insert(0, str(root))
    old = importlib.import_module("baseline_protocol.codec")
    messages = importlib.import_module("baseline_protocol.messages")
    control = importlib.import_module("baseline_protocol.control")

    def typed_or(family: str, from_wire: Callable[[Any], Any]) -> Callable[[bytes], Any]:
        decoder = getattr(old, family, None)
        return decoder.decode if decoder is not None else lambda frame: from_wire(old.decode(frame))

    decoders = {
        "request": typed_or("REQUESTS", getattr(messages, "request_from_wire", None)),
        "reply": typed_or("REPLIES", getattr(messages, "reply_from_wire", None)),
        "control": typed_or("CONTROL", getattr(control, "control_from_wire", None)),
    }
    return decoders, old.encode


def per_call_us(function: Callable[[], Any], budget_s: float = 0.2) -> float:
    timer = timeit.Timer(function)
    number, _ = timer.autorange()
    number = max(1, int(number * budget_s / 0.2))
    return min(timer.repeat(repeat=5, number=number)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a git revision whose protocol/ to compare against")
    args = parser.parse_args()
    current = {"request": codec.REQUESTS.decode, "reply": codec.REPLIES.decode, "control": codec.CONTROL.decode}
    baseline, baseline_encode = load_baseline(args.baseline) if args.baseline else (None, None)

    header = f"{'message':26} {'bytes':>8} {'encode µs':>10} {'decode µs':>10}"
    if baseline:
        header += f" {'base enc µs':>12} {'base dec µs':>12} {'dec speed-up':>12}"
    print(header)
    for name, message, family in MESSAGES:
        frame = codec.encode(message)
        assert current[family](frame) == message
        encode_us = per_call_us(lambda: codec.encode(message))
        decode_us = per_call_us(lambda: current[family](frame))
        line = f"{name:26} {len(frame):>8} {encode_us:>10.2f} {decode_us:>10.2f}"
        if baseline:
            decoded = baseline[family](frame)  # the same bytes must be valid for both
            assert type(decoded).__name__ == type(message).__name__
            old_encode_us = per_call_us(lambda: baseline_encode(decoded))
            old_us = per_call_us(lambda: baseline[family](frame))
            line += f" {old_encode_us:>12.2f} {old_us:>12.2f} {old_us / decode_us:>11.1f}x"
        print(line)


if __name__ == "__main__":
    main()
