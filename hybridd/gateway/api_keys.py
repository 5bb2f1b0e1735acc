"""The gateway's API keys: the file `http_api_key_file` names, one key per line.

Blank lines and lines starting with `#` are skipped; a file with no key is an error
(an empty file would otherwise mean "no key needed" by accident). Clients send a key
as `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import hmac
from pathlib import Path


def load_api_keys(path: str | Path) -> frozenset[str]:
    """The keys in `path`; OSError when unreadable, ValueError when it holds none."""
    lines = Path(path).read_text().splitlines()
    keys = frozenset(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"http_api_key_file {path}: no API key in it")
    return keys


def key_matches(token: str, keys: frozenset[str]) -> bool:
    """Whether `token` is one of `keys`, compared in constant time."""
    candidate = token.strip().encode()
    return any(hmac.compare_digest(candidate, key.encode()) for key in keys)
