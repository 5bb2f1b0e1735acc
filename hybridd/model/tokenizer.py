"""The tokenizer of a model directory, loaded offline through transformers' AutoTokenizer."""

from __future__ import annotations

from pathlib import Path

from hybridd.model.errors import ModelLoadError


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    has_files = any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    if not has_files:
        raise ModelLoadError(f"{model_dir}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer ({exc})") from exc
