"""Strict JSON both ways: read only what RFC 8259 allows, write nothing it forbids.

Python's `json` reads `NaN`, `Infinity`, `1e400` (as inf) and duplicate keys (the last one
silently wins), and writes non-finite floats as `NaN`/`Infinity`. Files we read from users or
checkpoints go through `loads`, which refuses them all; documents we print or write go through
`finite`, which turns non-finite floats into null.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from dsparkctl.errors import InputError


class StrictJSONError(ValueError):
    """Valid for Python's json, not for JSON: a duplicate key or a NaN/Infinity constant."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise StrictJSONError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise StrictJSONError(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise StrictJSONError(f"{text} overflows a float")
    return value


def _int(text: str) -> int:
    if len(text) > 400:  # Python refuses 4300 digits with a bare ValueError; no number of ours has 400
        raise StrictJSONError(f"{text[:24]}… ({len(text)} digits) is too large a number")
    return int(text)


def loads(raw: str | bytes) -> Any:
    """`json.loads` refusing duplicate keys, NaN/Infinity and overflowing numbers (floats beyond
    1.8e308, integers of hundreds of digits; each reader checks its fields' own ranges).

    Raises StrictJSONError (also for nesting deeper than Python's parser recurses), or
    json.JSONDecodeError / UnicodeDecodeError for what is not JSON at all."""
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constant, parse_float=_float,
                          parse_int=_int)
    except RecursionError:
        raise StrictJSONError("nested too deeply to read (thousands of levels)") from None


def finite(obj: Any) -> Any:
    """A copy of `obj` (dicts, lists, tuples, scalars) with every non-finite float replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def read(path: str | os.PathLike, what: str, hint: str) -> Any:
    """Parse a user's JSON file strictly; missing, not a file, not UTF-8, not JSON: one-line InputError."""

    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} {path} does not exist", hint)
    if not path.is_file():
        raise InputError(f"{what} {path} is not a regular file", hint)
    try:
        return loads(path.read_bytes())
    except StrictJSONError as exc:
        raise InputError(f"{path}: {exc}", hint) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 (byte {exc.object[exc.start]:#04x} at offset {exc.start})", hint) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})", hint) from None
