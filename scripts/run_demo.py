"""The README's main job: generate a continuation with hybridd's engine core.

Uses the embedded default model when it is present (hybridd/assets/tiny-shakespeare),
otherwise a tiny random Llama built on the fly; the daemon replaces this later.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from hybridd.model import load_model, load_tokenizer
from hybridd.model.generate import greedy_generate

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = ROOT / "hybridd" / "assets" / "tiny-shakespeare"


def main() -> int:
    prompt = sys.argv[1] if len(sys.argv) > 1 else "ROMEO:"
    if (EMBEDDED / "model.safetensors").is_file():
        model = load_model(EMBEDDED, dtype=torch.float32)
        tokenizer = load_tokenizer(EMBEDDED)
        ids = tokenizer.encode(prompt)
        out = greedy_generate(model, [ids], 64)[0]
        print(prompt + tokenizer.decode(out))
        return 0
    sys.path.insert(0, str(ROOT))
    from tests.tiny_models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model("llama", Path(tmp))
        model = load_model(tmp, dtype=torch.float32)
        out = greedy_generate(model, [[1, 5, 9, 17]], 16)[0]
        print("no embedded model yet; random tiny Llama generated token ids:", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
