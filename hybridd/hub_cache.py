"""A model named by its Hugging Face hub id (`ORG/NAME`), found in the local hub cache.

hybridd never downloads: `hybridd start --model meta-llama/Llama-3.1-8B-Instruct` serves
the snapshot that the cache's `refs/main` names, in the layout `hf download` writes
(`models--ORG--NAME/refs/main` holds a commit, `snapshots/<commit>/` the files). The
cache is `HF_HUB_CACHE`, else `HF_HOME/hub`, else `XDG_CACHE_HOME/huggingface/hub`,
else `~/.cache/huggingface/hub`, as huggingface_hub looks for it. A model that is a
path (it exists, or it does not look like `ORG/NAME`) is left as it is.
"""

from __future__ import annotations

import re
from pathlib import Path

from hybridd import environment

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class HubModelMissing(LookupError):
    """A hub id whose snapshot is not in the local cache; the message says how to get it."""


def cache_dir() -> Path:
    if (hub := environment.get("HF_HUB_CACHE")) is not None:
        return Path(hub).expanduser()
    if (home := environment.get("HF_HOME")) is not None:
        return Path(home).expanduser() / "hub"
    xdg = environment.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path("~/.cache").expanduser()) / "huggingface" / "hub"


def is_hub_id(model: str) -> bool:
    return _HUB_ID.fullmatch(model) is not None and not Path(model).exists()


def resolve(model: str) -> str:
    """The directory to load `model` from: itself, or a hub id's cached snapshot."""
    if not is_hub_id(model):
        return model
    cache = cache_dir()
    entry = cache / ("models--" + model.replace("/", "--"))
    try:
        commit = (entry / "refs" / "main").read_text().strip()
    except OSError:
        commit = ""
    snapshot = entry / "snapshots" / commit
    if commit and (snapshot / "config.json").is_file():
        return str(snapshot)
    raise HubModelMissing(f"model {model}: not a directory, and not in the Hugging Face cache {cache}; "
                          f"download it first with `hf download {model}` (or pass a model directory)")
