"""The byte layout of a shared arena: named regions, their shapes, dtypes and offsets.

Both sides of an arena derive identical tensor views from a layout, so the layout
travels in the arena manifest. Offsets are aligned to 256 bytes (enough for any
vectorized load and for CUDA's allocation granularity of tensor bases).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridd.protocol.errors import ErrorCode, ProtocolError

ALIGNMENT = 256

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


def _align(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


class ArenaLayout:
    """An ordered set of regions; build it from `{name: (shape, dtype)}`."""

    def __init__(self, spec: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
        regions: dict[str, Region] = {}
        offset = 0
        for name, (shape, dtype) in spec.items():
            shape = tuple(int(d) for d in shape)
            if dtype not in DTYPES:
                raise ValueError(f"region {name!r}: unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
            if not shape or any(d <= 0 for d in shape):
                raise ValueError(f"region {name!r}: shape {shape} must have at least one dimension, all > 0")
            offset = _align(offset)
            regions[name] = Region(name=name, offset=offset, shape=shape, dtype=dtype)
            offset += regions[name].nbytes
        if not regions:
            raise ValueError("an arena layout needs at least one region")
        self.regions: dict[str, Region] = regions
        self.nbytes: int = _align(offset)

    def __iter__(self) -> Iterator[Region]:
        return iter(self.regions.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ArenaLayout) and self.regions == other.regions

    def __repr__(self) -> str:
        return f"ArenaLayout({len(self.regions)} regions, {self.nbytes} bytes)"

    def to_wire(self) -> dict[str, dict[str, Any]]:
        return {r.name: {"offset": r.offset, "shape": list(r.shape), "dtype": r.dtype} for r in self}

    @classmethod
    def from_wire(cls, regions: Any, path: str = "regions") -> ArenaLayout:
        """Rebuild from a manifest's regions, checking that the offsets are the ones we derive."""
        if not isinstance(regions, Mapping) or not regions:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{path}: expected a non-empty map", field=path)
        spec: dict[str, tuple[tuple[int, ...], str]] = {}
        offsets: dict[str, Any] = {}
        for name, region in regions.items():
            where = f"{path}.{name}"
            if not isinstance(region, Mapping) or set(region) != {"offset", "shape", "dtype"}:
                raise ProtocolError(
                    ErrorCode.INVALID_REQUEST, f"{where}: expected a map of offset, shape, dtype", field=where
                )
            shape, dtype = region["shape"], region["dtype"]
            if not isinstance(shape, list | tuple) or not all(type(d) is int for d in shape):
                raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{where}.shape: expected integers", field=f"{where}.shape")
            spec[str(name)] = (tuple(shape), dtype)
            offsets[str(name)] = region["offset"]
        try:
            layout = cls(spec)
        except ValueError as error:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{path}: {error}", field=path) from None
        for region in layout:
            if offsets[region.name] != region.offset:
                where = f"{path}.{region.name}.offset"
                raise ProtocolError(
                    ErrorCode.INVALID_REQUEST,
                    f"{where}: {offsets[region.name]} differs from the derived offset {region.offset}",
                    field=where,
                )
        return layout
