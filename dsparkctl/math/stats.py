"""Acceptance statistics, defined once for every command that reports them.

Per round (one request, one verification) we record the verify length ℓ and the accepted
count a (0 ≤ a ≤ ℓ ≤ γ). From the counts:

    rounds          number of rounds
    tokens          Σ (1 + a)            every round emits the accepted drafts plus one token
    tau             tokens / rounds      accepted length, bonus INCLUDED (vLLM/SGLang/paper τ)
    verified        Σ ℓ                  draft tokens sent to the target
    histogram[a]    rounds that accepted exactly a drafts, a = 0..γ
    reached[j]      rounds where position j was tested: j ≤ ℓ and j ≤ a + 1     (j = 1..γ)
    accepted_at[j]  rounds where position j was accepted: j ≤ a
    conditional c_j = accepted_at[j] / reached[j]   P(j accepted | 1..j-1 accepted, j verified)
    survival    a_j = Π_{i≤j} c_i                   P(first j drafts accepted)
    draft acceptance rate = Σ a / Σ ℓ               vLLM's "draft acceptance rate" (accepted draft
                                                    tokens / draft tokens verified; vLLM prints %)
    verify rate = Σ (1 + a) / (Σ ℓ + rounds)        DeepSpec's `verify_rate`: emitted tokens per
                                                    token the target scored (the ℓ drafts + 1 each)
Under full verification (ℓ = γ every round) a_j is exactly #rounds(a ≥ j) / rounds; with
shorter, possibly adaptive verify lengths the product of conditionals is the estimator that
uses only positions that were actually tested.

The functions `conditional_acceptance`, `survival_from_conditional`, `survival_full` and
`tau_full` are these definitions; `AcceptanceStats` (live rounds) and the teacher-forced
statistics (evaluation/teacher_forced.py, expected counts over anchors) both compute through them.

Lists in the public API are indexed by position j = 1..γ as list index j-1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = ["AcceptanceStats", "acceptance_intervals", "conditional_acceptance", "mean_interval", "prompt_intervals", "reached_bounds",
           "survival_from_conditional", "survival_full", "tau_full", "wilson_interval"]

MIN_UNITS = 8  # independent units (prompts) below which a bootstrap over them is not an interval worth printing

FORMAT = "dsparkctl-acceptance/1"


def wilson_interval(successes: float, trials: float, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; (0.0, 1.0) when trials == 0."""
    if trials <= 0:
        return (0.0, 1.0)
    if successes < 0 or successes > trials:
        raise ValueError(f"successes must be in [0, trials], got {successes}/{trials}")
    p = successes / trials
    z2 = z * z
    denom = 1.0 + z2 / trials
    center = (p + z2 / (2 * trials)) / denom
    half = z / denom * math.sqrt(max(p * (1 - p) / trials + z2 / (4 * trials * trials), 0.0))
    return (max(0.0, center - half), min(1.0, center + half))


def conditional_acceptance(accepted_at: Sequence[float], reached: Sequence[float]) -> list[float | None]:
    """c_j = accepted_at[j] / reached[j]: of the rounds that tested position j, the share that
    accepted it; None where none did. The counts may be expected counts (teacher forcing: Σ_a s_j(a)
    over Σ_a s_{j-1}(a))."""
    return [float(a / n) if n > 0 else None for a, n in zip(accepted_at, reached)]


def survival_from_conditional(conditional: Sequence[float | None]) -> list[float | None]:
    """a_j = Π_{i≤j} c_i, the estimator that uses only positions actually tested (any verify
    lengths). Once the product is 0 it stays 0; None once undefined."""
    out: list[float | None] = []
    prod: float | None = 1.0
    for c in conditional:
        if prod is None or prod == 0.0:
            pass
        elif c is None:
            prod = None
        else:
            prod *= c
        out.append(prod)
    return out


def survival_full(accepted_at: Sequence[float], rounds: float) -> list[float | None]:
    """a_j = accepted_at[j] / rounds: exact under full verification (every round tests position j
    unless an earlier one was rejected, so accepted_at[j] counts the rounds whose first j drafts
    passed); None for every position without rounds."""
    if not rounds > 0:
        return [None] * len(accepted_at)
    return [float(a / rounds) for a in accepted_at]


def tau_full(survival: Sequence[float | None]) -> float | None:
    """τ = 1 + Σ_j a_j: tokens per round under full verification (each round emits its accepted
    drafts, Σ_j 1[first j accepted], plus one token); None when a_1 is undefined. With any verify
    lengths τ is counted directly, as `AcceptanceStats.tau` = tokens / rounds."""
    return None if survival[0] is None else 1.0 + float(sum(survival))


def mean_interval(histogram: Sequence[int], offset: float = 1.0, z: float = 1.96) -> tuple[float, float] | None:
    """Normal interval of the mean of `offset + j` over rounds, `histogram[j]` of which accepted j
    drafts (τ with offset 1); None without rounds. Rounds are counted as independent."""
    n = float(sum(histogram))
    if n <= 0:
        return None
    mean = sum((offset + j) * c for j, c in enumerate(histogram)) / n
    var = sum(c * (offset + j - mean) ** 2 for j, c in enumerate(histogram)) / max(n - 1.0, 1.0)
    half = z * math.sqrt(var / n)
    return (mean - half, mean + half)


def reached_bounds(accepted_at: Sequence[int], rounds: int, length_at_least: Sequence[int | None] | None,
                   verified: int | None) -> list[tuple[int, int]]:
    """Bounds on reached[j] when an engine reports totals, not rounds. A round tests position j
    iff it verified ≥ j drafts and accepted the first j-1: with L_j = rounds verifying ≥ j,
    max(accepted_at[j], accepted_at[j-1] - (rounds - L_j)) ≤ reached[j] ≤ min(accepted_at[j-1], L_j)
    (accepted_at[0] = rounds). Where L_j is unknown, rounds - L_j is at most the slots the
    verified total leaves empty, γ·rounds - verified (unbounded when `verified` is None too).
    Under full verification both bounds equal accepted_at[j-1], the exact count."""
    g = len(accepted_at)
    slack = None if verified is None else g * rounds - verified
    prev = rounds
    out = []
    for j in range(g):
        L = length_at_least[j] if length_at_least is not None and j < len(length_at_least) else None
        missing = (rounds - L) if L is not None else slack
        lo = accepted_at[j] if missing is None else max(accepted_at[j], prev - missing)
        hi = min(prev, L) if L is not None else prev
        out.append((int(lo), int(max(hi, lo))))
        prev = accepted_at[j]
    return out


def prompt_intervals(units: Sequence["AcceptanceStats"], level: float = 0.95, resamples: int = 2000,
                     seed: int = 0) -> dict | None:
    """95% percentile-bootstrap intervals of c_j, a_j and τ over independent units (prompts: the
    rounds of one prompt are correlated, so they are resampled together), or None with fewer than
    MIN_UNITS units that ran rounds. Positions no resample reached are None."""
    units = [u for u in units if u.rounds]
    if len(units) < MIN_UNITS:
        return None
    g = units[0].block_size
    acc = np.asarray([u.accepted_at for u in units], dtype=np.float64)  # [P, γ]
    reach = np.asarray([u.reached for u in units], dtype=np.float64)
    tok = np.asarray([u.tokens for u in units], dtype=np.float64)
    rnd = np.asarray([u.rounds for u in units], dtype=np.float64)
    rng = np.random.default_rng(seed)
    w = rng.multinomial(len(units), [1.0 / len(units)] * len(units), size=resamples).astype(np.float64)  # [B, P]
    A, N = w @ acc, w @ reach  # [B, γ]
    with np.errstate(invalid="ignore", divide="ignore"):
        cond = np.where(N > 0, A / N, np.nan)
        surv = np.cumprod(np.where(np.isnan(cond), 1.0, cond), axis=1)
        surv[np.isnan(cond).cumsum(axis=1) > 0] = np.nan
        tau = (w @ tok) / (w @ rnd)
    lo, hi = 100 * (1 - level) / 2, 100 * (1 + level) / 2

    def band(x: np.ndarray) -> tuple[float, float] | None:
        x = x[~np.isnan(x)]
        return (float(np.percentile(x, lo)), float(np.percentile(x, hi))) if x.size >= resamples // 2 else None
    return {"unit": "prompt", "units": len(units), "resamples": resamples,
            "conditional": [band(cond[:, j]) for j in range(g)], "survival": [band(surv[:, j]) for j in range(g)],
            "tau": band(tau)}


def acceptance_intervals(stats: "AcceptanceStats", units: Sequence["AcceptanceStats"]) -> dict:
    """The intervals a report prints beside c_j and a_j: over prompts (`prompt_intervals`, widened
    to Wilson's where that is wider: a position few rounds reached) when there are enough of them,
    else Wilson over rounds, which counts correlated rounds as independent (too narrow) and says
    so by its unit."""
    boot = prompt_intervals(units)
    cond, surv = stats.conditional_interval(), stats.survival_interval()
    if boot is None:
        return {"conditional_interval": cond, "survival_interval": surv, "interval_unit": "round",
                "interval_units": stats.rounds}

    def hull(b, w):  # a bootstrap over few rounds collapses (0 of 2 resamples to 0 always): never narrower than Wilson
        return [y if x is None or y is None else (min(x[0], y[0]), max(x[1], y[1])) for x, y in zip(b, w)]
    return {"conditional_interval": hull(boot["conditional"], cond), "survival_interval": hull(boot["survival"], surv),
            "tau_interval": boot["tau"], "interval_unit": "prompt", "interval_units": boot["units"]}


def _as_int_array(values) -> np.ndarray:
    if hasattr(values, "detach"):  # torch tensor, without importing torch here
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


@dataclass
class AcceptanceStats:
    block_size: int
    rounds: int = 0
    tokens: int = 0
    verified: int = 0
    histogram: list[int] = field(default_factory=list)    # [γ+1]
    reached: list[int] = field(default_factory=list)      # [γ], position j at index j-1
    accepted_at: list[int] = field(default_factory=list)  # [γ]

    def __post_init__(self) -> None:
        g = int(self.block_size)
        if g < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self.block_size = g
        self.histogram = list(self.histogram) or [0] * (g + 1)
        self.reached = list(self.reached) or [0] * g
        self.accepted_at = list(self.accepted_at) or [0] * g
        if len(self.histogram) != g + 1 or len(self.reached) != g or len(self.accepted_at) != g:
            raise ValueError("histogram must have block_size+1 entries, reached/accepted_at block_size")

    # ---- recording ------------------------------------------------------------------------
    def add_rounds(self, verify_lengths: Sequence[int], accepted: Sequence[int]) -> None:
        """Record rounds; verify_lengths[i] and accepted[i] describe one round (lists or tensors)."""
        ell = _as_int_array(verify_lengths)
        acc = _as_int_array(accepted)
        if ell.shape != acc.shape:
            raise ValueError(f"verify_lengths and accepted differ in length: {ell.size} vs {acc.size}")
        if ell.size == 0:
            return
        g = self.block_size
        if (acc < 0).any() or (acc > ell).any() or (ell > g).any():
            raise ValueError(f"need 0 <= accepted <= verify_length <= block_size={g}")
        self.rounds += int(ell.size)
        self.tokens += int(ell.size + acc.sum())
        self.verified += int(ell.sum())
        hist = np.bincount(acc, minlength=g + 1)
        reach_len = np.minimum(ell, acc + 1)                      # last position tested
        reach_counts = np.bincount(reach_len, minlength=g + 1)     # how many stop at each length
        reached = reach_counts[::-1].cumsum()[::-1][1:]            # #rounds with reach_len >= j
        accepted_at = hist[::-1].cumsum()[::-1][1:]                # #rounds with acc >= j
        self.histogram = [int(a + b) for a, b in zip(self.histogram, hist)]
        self.reached = [int(a + b) for a, b in zip(self.reached, reached)]
        self.accepted_at = [int(a + b) for a, b in zip(self.accepted_at, accepted_at)]

    def add_round(self, verify_length: int, accepted: int) -> None:
        """One round, in plain Python (a request's own tally, one round at a time)."""
        if not 0 <= accepted <= verify_length <= self.block_size:
            raise ValueError(f"need 0 <= accepted <= verify_length <= block_size={self.block_size}")
        self.rounds += 1
        self.tokens += 1 + accepted
        self.verified += verify_length
        self.histogram[accepted] += 1
        for j in range(min(verify_length, accepted + 1)):
            self.reached[j] += 1
        for j in range(accepted):
            self.accepted_at[j] += 1

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        """A new object holding both sets of rounds (same block size required)."""
        if other.block_size != self.block_size:
            raise ValueError(f"cannot merge block sizes {self.block_size} and {other.block_size}")
        return AcceptanceStats(
            block_size=self.block_size,
            rounds=self.rounds + other.rounds,
            tokens=self.tokens + other.tokens,
            verified=self.verified + other.verified,
            histogram=[a + b for a, b in zip(self.histogram, other.histogram)],
            reached=[a + b for a, b in zip(self.reached, other.reached)],
            accepted_at=[a + b for a, b in zip(self.accepted_at, other.accepted_at)],
        )

    # ---- metrics --------------------------------------------------------------------------
    @property
    def tau(self) -> float | None:
        return self.tokens / self.rounds if self.rounds else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        """vLLM's draft acceptance rate as a fraction: accepted drafts / drafts verified."""
        return (self.tokens - self.rounds) / self.verified if self.verified else None

    @property
    def verify_rate(self) -> float | None:
        """DeepSpec's verify_rate: emitted tokens / (drafts verified + one bonus slot per round)."""
        return self.tokens / (self.verified + self.rounds) if self.rounds else None

    def conditional(self) -> list[float | None]:
        """c_j = accepted_at[j] / reached[j]; None where position j was never tested."""
        return conditional_acceptance(self.accepted_at, self.reached)

    def survival(self) -> list[float | None]:
        """a_j = Π_{i≤j} c_i (`survival_from_conditional`). Once the product is 0 it stays 0; None once undefined."""
        return survival_from_conditional(self.conditional())

    def conditional_interval(self, z: float = 1.96) -> list[tuple[float, float] | None]:
        """Wilson interval of each c_j over the rounds that reached j (None if none did)."""
        return [wilson_interval(a, n, z) if n else None for a, n in zip(self.accepted_at, self.reached)]

    def survival_interval(self, z: float = 1.96) -> list[tuple[float, float] | None]:
        """Wilson interval for a_j with an effective sample size from the delta method.

        The c_i are estimated from sequentially nested binomials, so to first order
        Var(â_j) = â_j² Σ_{i≤j} (1 - c_i) / (c_i n_i) with n_i = reached[i]. We set
        n_eff = â(1 - â) / Var(â) and report wilson_interval(â·n_eff, n_eff). Under full
        verification this n_eff equals `rounds` exactly, so the interval is the plain Wilson
        interval of #rounds(a ≥ j) / rounds. When â_j is 0 or 1 the delta method degenerates;
        we then use n_eff = the smallest reached[i] (i ≤ j, reached[i] > 0), which is
        conservative (wider). None where a_j is undefined.
        """
        cond = self.conditional()
        surv = self.survival()
        out: list[tuple[float, float] | None] = []
        for j, a in enumerate(surv):
            if a is None:
                out.append(None)
                continue
            ns = [self.reached[i] for i in range(j + 1) if self.reached[i] > 0]
            if 0.0 < a < 1.0 and all(cond[i] is not None and cond[i] > 0 for i in range(j + 1)):
                var_rel = sum((1 - cond[i]) / (cond[i] * self.reached[i]) for i in range(j + 1))
                n_eff = a * (1 - a) / (a * a * var_rel) if var_rel > 0 else float(min(ns))
            else:
                n_eff = float(min(ns)) if ns else 0.0
            out.append(wilson_interval(a * n_eff, n_eff, z) if n_eff > 0 else (0.0, 1.0))
        return out

    # ---- JSON -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        """Raw counts plus derived metrics (derived ones are informational; from_json ignores them)."""
        return {
            "format": FORMAT,
            "block_size": self.block_size,
            "rounds": self.rounds,
            "tokens": self.tokens,
            "verified": self.verified,
            "histogram": list(self.histogram),
            "reached": list(self.reached),
            "accepted_at": list(self.accepted_at),
            "tau": self.tau,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "verify_rate": self.verify_rate,
            "conditional": self.conditional(),
            "survival": self.survival(),
        }

    @classmethod
    def from_json(cls, d: dict) -> "AcceptanceStats":
        if d.get("format", FORMAT) != FORMAT:
            raise ValueError(f"unknown acceptance-stats format {d.get('format')!r}")
        try:
            stats = cls(
                block_size=int(d["block_size"]),
                rounds=int(d["rounds"]),
                tokens=int(d["tokens"]),
                verified=int(d.get("verified", 0)),
                histogram=[int(x) for x in d["histogram"]],
                reached=[int(x) for x in d["reached"]],
                accepted_at=[int(x) for x in d["accepted_at"]],
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed acceptance stats: {exc}") from exc
        if sum(stats.histogram) != stats.rounds:
            raise ValueError("malformed acceptance stats: histogram does not sum to rounds")
        before = [stats.rounds, *stats.accepted_at[:-1]]  # a position is tested only after the one before passed
        beyond = [sum(stats.histogram[j + 1:]) for j in range(stats.block_size)]  # rounds that accepted > j drafts
        if (min(stats.histogram + stats.reached + stats.accepted_at + [stats.verified]) < 0
                or any(not a <= n <= b for a, n, b in zip(stats.accepted_at, stats.reached, before))
                or stats.accepted_at != beyond or sum(stats.reached) > stats.verified
                or stats.tokens != sum((1 + j) * c for j, c in enumerate(stats.histogram))):
            raise ValueError("malformed acceptance stats: the counts contradict each other (accepted within reached "
                             "within the position before, accepted_at the histogram's tail sums, reached within "
                             "verified, tokens = Σ (1 + a) over rounds, none negative)")
        return stats
