"""`audit`: check the settings, run the chi-square losslessness audit of each policy (math/audit.py)
and return its report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dsparkctl.errors import UsageError, option
from dsparkctl.math.audit import audit_policies, check_alpha

MIN_AUDIT_ROUNDS = 1000  # fewer request-rounds per run leave a chi-square test nothing to find


MAX_AUDIT_ROUNDS = 100_000_000  # 500× the default: a typo such as 99999999999 would run for days


MAX_RANDOM_SETTINGS = 10_000


@dataclass(frozen=True)
class AuditSpec:
    """Everything `audit` runs (`run_audit` checks it)."""
    policies: tuple[str, ...] = ("retrospective", "dspark", "dspark-async", "static:1", "static:2", "threshold:0.6",
                                 "survival:0.3", "budget:2")
    rounds: int = 200_000  # request-rounds per policy and setting
    plain_rounds: int = 40_000  # ... on the settings whose SPS table prices a plain step
    random_settings: int = 3  # randomised settings besides Appendix A
    alpha: float = 1e-3  # chi-square significance level
    seed: int = 0


def run_audit(spec: AuditSpec, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """`audit` as one call: check the spec, audit every policy on every setting (`audit_policies`),
    return {"alpha", "results" (one `AuditResult.to_json()` each), "unexpected_failures" (policies
    claimed lossless that failed)}. `progress(done, total)` counts the (setting, policy) runs."""
    check_alpha(spec.alpha, option("alpha"))
    for field, n in (("rounds", spec.rounds), ("plain_rounds", spec.plain_rounds)):
        if n < MIN_AUDIT_ROUNDS:
            raise UsageError(f"{option(field)} {n} is too few for a chi-square test",
                             f"use at least {MIN_AUDIT_ROUNDS}")
        if n > MAX_AUDIT_ROUNDS:
            raise UsageError(f"{option(field)} {n:,} is more than {MAX_AUDIT_ROUNDS:,} (days of sampling)",
                             f"use at most {MAX_AUDIT_ROUNDS:,}; the default {AuditSpec.rounds:,} finds a "
                             "biased rule")
    if spec.random_settings < 0:
        raise UsageError(f"{option('random_settings')} {spec.random_settings} is negative",
                         "use 0 for Appendix A only, e.g. 3")
    if spec.random_settings > MAX_RANDOM_SETTINGS:
        raise UsageError(f"{option('random_settings')} {spec.random_settings:,} is more than {MAX_RANDOM_SETTINGS:,}",
                         "e.g. 3 (each setting audits every policy again)")
    results = audit_policies(spec.policies, spec.rounds, spec.random_settings, spec.alpha, spec.seed,
                             plain_rounds=spec.plain_rounds, progress=progress)
    return {"alpha": spec.alpha, "results": [r.to_json() for r in results],
            "unexpected_failures": sum(r.claimed_lossless and not r.passed for r in results)}
