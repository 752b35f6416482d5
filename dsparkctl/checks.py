"""Checks of plain values every layer may run: counts are at least 1, and seeds fit a torch.Generator
with room for the per-cell seeds derived from them.
"""

from __future__ import annotations

from dsparkctl.errors import UsageError, option


def check_positive(value: int, field: str) -> None:
    """The one rule for counts (tokens, requests, prompts): at least 1, named as `errors.option(field)`."""
    if value < 1:
        raise UsageError(f"{option(field)} must be >= 1, got {value}")


SEED_LIMIT = 2 ** 32  # derived seeds (seed · 1_000_003 + cell) stay inside torch's 64-bit range


def check_seed(seed: int) -> None:
    if not 0 <= seed < SEED_LIMIT:
        raise UsageError(f"{option('seed')} {seed} is out of range", hint=f"use an integer in [0, {SEED_LIMIT})")
