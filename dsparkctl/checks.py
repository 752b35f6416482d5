"""Checks of plain values every layer may run: counts are at least 1, and seeds fit a torch.Generator
with room for the per-cell seeds derived from them.
"""

from __future__ import annotations

import math
import re

from dsparkctl.errors import UsageError, option


def check_positive(value: int, field: str) -> None:
    """The one rule for counts (tokens, requests, prompts): at least 1, named as `errors.option(field)`."""
    if value < 1:
        raise UsageError(f"{option(field)} must be >= 1, got {value}", f"give {option(field)} 1 or more")


SEED_LIMIT = 2 ** 32  # derived seeds (seed · 1_000_003 + cell) stay inside torch's 64-bit range


def check_seed(seed: int) -> None:
    if not 0 <= seed < SEED_LIMIT:
        raise UsageError(f"{option('seed')} {seed} is out of range", hint=f"use an integer in [0, {SEED_LIMIT})")


INT64_MAX = 2 ** 63 - 1  # the largest count a tensor, a file offset or a seed can hold
_ASCII_INT = re.compile(r"[+-]?[0-9]+")
_ASCII_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def ascii_int(text: str) -> int | None:
    """`text` as an integer written in ASCII digits that fits int64, else None. Python's int() also
    takes "５" (a full-width digit), "1_000", " 5\\n" and a 400-digit number."""
    if not isinstance(text, str) or len(text) > 20 or not _ASCII_INT.fullmatch(text):
        return None
    v = int(text)
    return v if -INT64_MAX <= v <= INT64_MAX else None


def ascii_float(text: str) -> float | None:
    """`text` as a finite number written in ASCII (digits, a point, an exponent), else None; float()
    also takes "５", "1_0", "nan", "inf" and "1e400" (which is inf)."""
    if not isinstance(text, str) or len(text) > 100 or not _ASCII_FLOAT.fullmatch(text):
        return None
    v = float(text)
    return v if math.isfinite(v) else None


def check_number_range(value: object, field: str) -> None:
    """A number a command was given: an int that fits int64, a float that is finite (NaN, inf and
    1e400 are no count, rate or fraction of ours)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not -INT64_MAX <= value <= INT64_MAX:
        shown = str(value) if len(str(value)) <= 24 else f"{str(value)[:12]}… ({len(str(value))} digits)"
        raise UsageError(f"{option(field)} {shown} is out of range", f"use an integer below {INT64_MAX:,}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{option(field)} must be a finite number, got {value}", "give an ordinary finite number (not nan or inf)")
