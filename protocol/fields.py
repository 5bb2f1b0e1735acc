"""Typed, bounded reading of fields out of one decoded msgpack map.

`FieldReader` is the single place where wire types are checked: every message's
`from_wire` reads its fields through one, and `finish()` rejects whatever was not
read. Size violations raise `too_large`; every other violation `invalid_request`;
both name the field by its dotted path (`sampling.stop[2]`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from hybridd.protocol.errors import ErrorCode, ProtocolError


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()
"""Default meaning "this field is required"."""


def _invalid(path: str, message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_REQUEST, f"{path}: {message}", field=path)


def _too_large(path: str, message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.TOO_LARGE, f"{path}: {message}", field=path)


def _type_name(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


class FieldReader:
    """Reads the fields of one map; `prefix` is the map's own path ("" at top level)."""

    def __init__(self, data: Any, prefix: str = "") -> None:
        if not isinstance(data, Mapping):
            raise _invalid(prefix or "message", f"expected a map, got {_type_name(data)}")
        self._data = data
        self._prefix = prefix
        self._seen: set[str] = set()

    def path(self, key: str) -> str:
        return f"{self._prefix}.{key}" if self._prefix else key

    def _get(self, key: str, default: Any) -> tuple[bool, Any]:
        """(present, value); nil counts as absent for optional fields."""
        self._seen.add(key)
        value = self._data.get(key)
        if value is None:
            if default is MISSING:
                reason = "is required" if key not in self._data else "must not be nil"
                raise _invalid(self.path(key), reason)
            return False, default
        return True, value

    def keys(self) -> list[str]:
        """The map's keys (strings: the codec's strict_map_key allows only str and bin)."""
        keys = list(self._data)
        for key in keys:
            if type(key) is not str:
                raise _invalid(self.path(repr(key)), "map keys must be strings")
        return keys

    def has(self, key: str) -> bool:
        return self._data.get(key) is not None

    def string(
        self,
        key: str,
        default: Any = MISSING,
        *,
        min_chars: int = 0,
        max_chars: int | None = None,
        choices: frozenset[str] | None = None,
    ) -> Any:
        present, value = self._get(key, default)
        return check_str(value, self.path(key), min_chars=min_chars, max_chars=max_chars, choices=choices) if present else value

    def integer(self, key: str, default: Any = MISSING, *, lo: int | None = None, hi: int | None = None) -> Any:
        present, value = self._get(key, default)
        return check_int(value, self.path(key), lo=lo, hi=hi) if present else value

    def number(
        self,
        key: str,
        default: Any = MISSING,
        *,
        lo: float | None = None,
        hi: float | None = None,
        lo_open: bool = False,
    ) -> Any:
        present, value = self._get(key, default)
        return check_float(value, self.path(key), lo=lo, hi=hi, lo_open=lo_open) if present else value

    def boolean(self, key: str, default: Any = MISSING) -> Any:
        present, value = self._get(key, default)
        if present and type(value) is not bool:
            raise _invalid(self.path(key), f"expected a bool, got {_type_name(value)}")
        return value

    def binary(self, key: str, default: Any = MISSING, *, max_len: int | None = None) -> Any:
        present, value = self._get(key, default)
        if not present:
            return value
        if type(value) is not bytes:
            raise _invalid(self.path(key), f"expected bin, got {_type_name(value)}")
        if max_len is not None and len(value) > max_len:
            raise _too_large(self.path(key), f"{len(value)} bytes exceeds the limit of {max_len}")
        return value

    def mapping(self, key: str, default: Any = MISSING) -> Any:
        present, value = self._get(key, default)
        if present and not isinstance(value, Mapping):
            raise _invalid(self.path(key), f"expected a map, got {_type_name(value)}")
        return value

    def nested(self, key: str) -> FieldReader:
        """A reader for a required nested map."""
        return FieldReader(self.mapping(key), self.path(key))

    def nested_optional(self, key: str) -> FieldReader | None:
        """A reader for an optional nested map; None when absent or nil."""
        value = self.mapping(key, None)
        return None if value is None else FieldReader(value, self.path(key))

    def _list(self, key: str, default: Any, max_items: int | None) -> tuple[bool, Any]:
        present, value = self._get(key, default)
        if not present:
            return False, value
        if not isinstance(value, list | tuple):
            raise _invalid(self.path(key), f"expected an array, got {_type_name(value)}")
        if max_items is not None and len(value) > max_items:
            raise _too_large(self.path(key), f"{len(value)} items exceeds the limit of {max_items}")
        return True, value

    def integer_list(
        self,
        key: str,
        default: Any = MISSING,
        *,
        max_items: int | None = None,
        min_items: int = 0,
        lo: int | None = None,
        hi: int | None = None,
    ) -> Any:
        present, value = self._list(key, default, max_items)
        if not present:
            return value
        path = self.path(key)
        if len(value) < min_items:
            raise _invalid(path, f"needs at least {min_items} item(s)")
        # The common case (a long prompt of token ids) is checked in bulk; the
        # per-item walk only runs to name the offending index.
        if all(type(x) is int for x in value) and (lo is None or min(value, default=lo) >= lo) and (
            hi is None or max(value, default=hi) <= hi
        ):
            return list(value)
        for i, x in enumerate(value):
            check_int(x, f"{path}[{i}]", lo=lo, hi=hi)
        raise AssertionError("unreachable")  # pragma: no cover

    def string_list(
        self,
        key: str,
        default: Any = MISSING,
        *,
        max_items: int | None = None,
        min_chars: int = 0,
        max_chars: int | None = None,
    ) -> Any:
        present, value = self._list(key, default, max_items)
        if not present:
            return value
        path = self.path(key)
        return [check_str(x, f"{path}[{i}]", min_chars=min_chars, max_chars=max_chars) for i, x in enumerate(value)]

    def mapping_list(self, key: str, default: Any = MISSING, *, max_items: int | None = None) -> Any:
        """A list of maps: one reader per item, each named by its index (`messages[2]`)."""
        present, value = self._list(key, default, max_items)
        if not present:
            return value
        path = self.path(key)
        return [FieldReader(item, f"{path}[{i}]") for i, item in enumerate(value)]

    def skip(self, *keys: str) -> None:
        """Mark envelope fields that another layer has already checked."""
        self._seen.update(keys)

    def finish(self) -> None:
        unknown = sorted(str(k) for k in self._data if k not in self._seen)
        if unknown:
            raise _invalid(self.path(unknown[0]), "unknown field")


def check_str(
    value: Any,
    path: str,
    *,
    min_chars: int = 0,
    max_chars: int | None = None,
    choices: frozenset[str] | None = None,
) -> str:
    if type(value) is not str:
        raise _invalid(path, f"expected a string, got {_type_name(value)}")
    if max_chars is not None and len(value) > max_chars:
        raise _too_large(path, f"{len(value)} characters exceeds the limit of {max_chars}")
    if len(value) < min_chars:
        raise _invalid(path, f"needs at least {min_chars} character(s)")
    if choices is not None and value not in choices:
        raise _invalid(path, f"{value!r} is not one of {sorted(choices)}")
    return value


def check_int(value: Any, path: str, *, lo: int | None = None, hi: int | None = None) -> int:
    # bool is a subclass of int in Python but a distinct msgpack type.
    if type(value) is not int:
        raise _invalid(path, f"expected an integer, got {_type_name(value)}")
    if lo is not None and value < lo:
        raise _invalid(path, f"{value} is below the minimum {lo}")
    if hi is not None and value > hi:
        raise _invalid(path, f"{value} is above the maximum {hi}")
    return value


def check_float(
    value: Any,
    path: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> float:
    # Integers are accepted: many encoders write 1.0 as the integer 1.
    if type(value) not in (float, int):
        raise _invalid(path, f"expected a number, got {_type_name(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise _invalid(path, f"{value} is not finite")
    if lo is not None and (result <= lo if lo_open else result < lo):
        raise _invalid(path, f"{value} must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and result > hi:
        raise _invalid(path, f"{value} is above the maximum {hi}")
    return result
