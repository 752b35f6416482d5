"""Policy specs: the registry of verify-length policies and the `name[:arg]` grammar that picks one.

`parse_policy("static:3")`, `parse_policy("dspark", sps=...)`: one of POLICY_SPECS, its argument
type-checked and range-checked here (K and B: integers >= 0; t: a number in [0, 1]). The list
every help text and hint prints is POLICY_SPECS, built from the same registry parse_policy reads.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dsparkctl.checks import ascii_float, ascii_int
from dsparkctl.errors import UsageError
from dsparkctl.math.policies import Budget, DSpark, DSparkAsync, Policy, Retrospective, Static, Survival, Threshold
from dsparkctl.math.sps import SPSTable

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Static, Threshold, Survival, DSpark, DSparkAsync, Budget,
                                                           Retrospective)}
POLICY_NAMES = tuple(POLICIES)
POLICY_SPECS = ", ".join(f"{n}:{p.arg}" if p.arg else n for n, p in POLICIES.items())  # "static:K, threshold:t, ..."
NEEDS_SPS = tuple(n for n, p in POLICIES.items() if p.needs_sps)
_ARG_RANGE = {"K": (int, 0, None), "B": (int, 0, None), "t": (float, 0.0, 1.0)}  # (type, lowest, highest)


def check_fits(policy: Policy, block_size: int) -> Policy:
    """`policy`, refused when it verifies more drafts than the draft's block holds."""
    k = getattr(policy, "k", None)
    if k is not None and not 0 <= int(k) <= block_size:
        raise UsageError(f"policy {policy.spec} verifies {k} drafts but the draft's block size is "
                         f"{block_size}", f"use static:K with K <= {block_size}")
    return policy


def parse_spec(spec: str) -> tuple[type[Policy], int | float | None]:
    """The policy class a spec names and its argument, type- and range-checked (nothing built)."""
    name, _, arg = spec.strip().partition(":")
    hint = f"policies: {POLICY_SPECS}"
    cls = POLICIES.get(name)
    if cls is None:
        raise UsageError(f"unknown policy {spec!r}", hint)
    if cls.arg is None:
        if arg:
            raise UsageError(f"policy {name!r} takes no argument, got {spec!r}", hint)
        return cls, None
    if not arg:
        raise UsageError(f"policy {spec!r} needs an argument", hint)
    kind, lo, hi = _ARG_RANGE[cls.arg]
    v = (ascii_int if kind is int else ascii_float)(arg)  # int() would take "５", "1_0", " 3"; float() "nan"
    if v is None:
        raise UsageError(f"policy {spec!r}: {arg!r} is not a valid {kind.__name__} (ASCII digits)", hint)
    if v != v or v < lo or (hi is not None and v > hi):  # v != v: NaN, which passes both bounds
        raise UsageError(f"policy {spec!r}: argument must be in [{lo}, {hi if hi is not None else '∞'}]", hint)
    return cls, v


def never_drafts(spec: str | None) -> bool:
    """Whether a spec names a policy that never drafts (static:0), read from the spec alone."""
    if spec is None:
        return False
    cls, v = parse_spec(spec)
    return cls.arg == "K" and int(v) == 0


def check_spec_fits(spec: str, block_size: int) -> None:
    """Refuse a spec that verifies more drafts than the draft's block holds (before building it)."""
    cls, v = parse_spec(spec)
    if cls.arg == "K" and not 0 <= int(v) <= block_size:
        raise UsageError(f"policy {spec.strip()} verifies {v} drafts but the draft's block size is "
                         f"{block_size}", f"use static:K with K <= {block_size}")


def parse_policy(spec: str, sps: SPSTable | None = None,
                 temperatures: torch.Tensor | Sequence[float] | None = None,
                 prior: torch.Tensor | Sequence[float] | None = None) -> Policy:
    """A policy from its spec, one of POLICY_SPECS (`static:K`, `threshold:t`, ..., `retrospective`).
    `prior`: the draft's typical survival profile `[γ]` (a calibration's held-out survival rates),
    where dspark and dspark-async start their skip decision before any step has drafted."""
    cls, v = parse_spec(spec)
    kw = {"sps": sps, "temperatures": temperatures, "prior": prior}
    return cls(spec, **kw) if v is None else cls(spec, v, **kw)
