"""Per-bucket graph statistics: what `hybridd status` shows about the static domain."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class BucketStats:
    kind: str  # "decode" | "prefill" | "mixed" (a prefill graph with a row for every running stream)
    size: int  # batch size (decode) or token count (prefill)
    captured: bool = False
    bytes: int = 0
    capture_s: float = 0.0
    captures: int = 0  # successful captures, a re-capture after an eviction included
    uploaded: bool = False  # the live graph was uploaded to the device before its first replay
    replays: int = 0
    eager_runs: int = 0
    demand: int = 0
    evictions: int = 0
    disabled: str | None = None  # why this bucket will not be captured

    def to_dict(self) -> dict:
        # Its fields are plain values: a copy of them is `asdict`'s answer, at a fiftieth of
        # its cost (the graph generator snapshots every bucket each second, between steps).
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = tuple(field.name for field in fields(BucketStats))
