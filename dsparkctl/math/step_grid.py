"""The steps-per-second grid: milliseconds of one step by requests × tokens per request, fitted
monotone (`fit_step_grid`), and the limits every table's numbers must keep (see `math.sps`)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from dsparkctl.errors import InputError

VERIFY_LAYOUTS = ("padded", "ragged")
MAX_BATCH_TOKENS = 2 ** 31 - 1  # tokens in one forward step; far beyond any engine
MIN_STEPS_PER_SEC, MAX_STEPS_PER_SEC = 1e-6, 1e9  # a step of 11 days or under a nanosecond is a unit error


def isotonic(y: Sequence[float], w: Sequence[float] | None = None) -> list[float]:
    """Least-squares non-decreasing fit of `y` (weights `w`, default 1): pool adjacent violators."""
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for i, v in enumerate(y):
        blocks.append([float(v), float(w[i]) if w is not None else 1.0, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks[-1]
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    out: list[float] = []
    for m, _, n in blocks:
        out.extend([m] * n)
    return out


def fit_step_grid(ms: Sequence[Sequence[float]], weights: Sequence[Sequence[float]] | None = None,
                  sweeps: int = 50) -> list[list[float]]:
    """A grid of step times `[R probes][t probes]` fitted non-decreasing along both axes.

    Alternating isotonic passes (along t for each R, then along R for each t) until nothing
    moves: each pass keeps what the other established except where it must lift a value, and
    the result is monotone in both directions (checked by the caller's validation)."""
    g = [list(map(float, row)) for row in ms]
    w = [list(map(float, row)) for row in weights] if weights is not None else [[1.0] * len(r) for r in g]
    for _ in range(sweeps):
        before = [row[:] for row in g]
        g = [isotonic(row, wr) for row, wr in zip(g, w)]
        cols = [isotonic([g[i][j] for i in range(len(g))], [w[i][j] for i in range(len(g))])
                for j in range(len(g[0]))]
        g = [[cols[j][i] for j in range(len(cols))] for i in range(len(g))]
        if max(abs(a - b) for ra, rb in zip(g, before) for a, b in zip(ra, rb)) <= 1e-12:
            break
    for i in range(len(g)):  # a last pass along t, then along R, leaves both non-decreasing up to rounding
        for j in range(1, len(g[i])):
            g[i][j] = max(g[i][j], g[i][j - 1])
    for j in range(len(g[0])):
        for i in range(1, len(g)):
            g[i][j] = max(g[i][j], g[i - 1][j])
    return g


class StepGrid:
    """Fitted whole-step times on a requests × tokens-per-request grid, and the plain step per R.

    requests   strictly increasing request counts R
    tokens     strictly increasing tokens per request t (1 = verify nothing; the draft still runs)
    step_ms    `[len(requests)][len(tokens)]` drafted step, ms, non-decreasing along both axes
    plain_ms   `[len(requests)]` step without a draft (one token per request), ms, non-decreasing;
               None when the table was profiled without it
    verify     how the engine lays out a step whose requests verify different lengths (VERIFY_LAYOUTS):
               "padded"  one [R, 1 + max ℓ] rectangle (dsparkctl's engine, like a batched HF forward):
                         the step costs what R requests × (1 + max ℓ) tokens cost;
               "ragged"  packed, Σ(1 + ℓ) tokens: priced at t = Σ(1 + ℓ) / R tokens per request.
    """

    def __init__(self, requests: Sequence[int], tokens: Sequence[int], step_ms: Sequence[Sequence[float]],
                 plain_ms: Sequence[float] | None = None, source: str = "SPS table", verify: str = "padded"):
        if verify not in VERIFY_LAYOUTS:
            raise InputError(f"{source}: grid verify layout {_clip(verify)} is not one of {', '.join(VERIFY_LAYOUTS)}",
                             "padded: the engine verifies a [requests, 1 + longest] rectangle; ragged: packed")
        self.verify = verify
        def ints(xs: Sequence[Any], name: str) -> list[int]:
            if not xs or not all(_whole(x) and 1 <= x <= MAX_BATCH_TOKENS for x in xs):
                raise InputError(f"{source}: grid {name} must be positive integers, got {_clip(xs)}",
                                 "profile again with `dsparkctl profile-sps`")
            xs = [int(x) for x in xs]
            if any(b <= a for a, b in zip(xs, xs[1:])):
                raise InputError(f"{source}: grid {name} {_clip(xs)} are not strictly increasing (probes out of order)",
                                 "profile again with `dsparkctl profile-sps`")
            return xs

        self.requests, self.tokens = ints(requests, "requests"), ints(tokens, "tokens_per_request")
        if (not isinstance(step_ms, (list, tuple)) or len(step_ms) != len(self.requests)
                or any(not isinstance(r, (list, tuple)) or len(r) != len(self.tokens) for r in step_ms)):
            raise InputError(f"{source}: grid step_ms must be a {len(self.requests)} × {len(self.tokens)} list of lists",
                             "profile again with `dsparkctl profile-sps`")
        self.step_ms = [[_ms(v, source) for v in row] for row in step_ms]
        self.plain_ms = None
        if plain_ms is not None:
            if not isinstance(plain_ms, (list, tuple)) or len(plain_ms) != len(self.requests):
                raise InputError(f"{source}: grid plain_ms must hold {len(self.requests)} values (one per request count)",
                                 "profile again with `dsparkctl profile-sps`")
            self.plain_ms = [_ms(v, source) for v in plain_ms]
        for i, row in enumerate(self.step_ms):
            for j in range(1, len(row)):
                if row[j] < row[j - 1] * (1 - 1e-9):
                    raise InputError(f"{source}: step time falls from {row[j - 1]:.4g} to {row[j]:.4g} ms at "
                                     f"{self.requests[i]} requests × {self.tokens[j]} tokens (not monotone)",
                                     "profile again with `dsparkctl profile-sps` (it fits a monotone grid); "
                                     "do not edit the fitted values")
        for j in range(len(self.tokens)):
            for i in range(1, len(self.requests)):
                if self.step_ms[i][j] < self.step_ms[i - 1][j] * (1 - 1e-9):
                    raise InputError(f"{source}: step time falls from {self.requests[i - 1]} to {self.requests[i]} "
                                     f"requests at {self.tokens[j]} tokens each (not monotone)",
                                     "profile again with `dsparkctl profile-sps` (it fits a monotone grid)")
        if self.plain_ms is not None and any(b < a * (1 - 1e-9) for a, b in zip(self.plain_ms, self.plain_ms[1:])):
            raise InputError(f"{source}: plain step time falls as requests grow (not monotone)",
                             "profile again with `dsparkctl profile-sps`")
        self._R = torch.tensor(self.requests, dtype=torch.float64)
        self._t = torch.tensor(self.tokens, dtype=torch.float64)
        self._ms = torch.tensor(self.step_ms, dtype=torch.float64)  # [nR, nt]

    def _along_r(self, values: torch.Tensor, R: float) -> torch.Tensor:
        """Interpolate `values [nR, ...]` at request count R (linear; held below the first probe,
        extended through the last two probes with slope ≥ 0 above the last)."""
        x = self._R
        if len(x) == 1 or R <= float(x[0]):
            return values[0]
        i = int(torch.searchsorted(x, torch.tensor(float(R), dtype=torch.float64), right=True)) - 1
        i = min(max(i, 0), len(x) - 2)
        frac = (R - float(x[i])) / float(x[i + 1] - x[i])
        if frac > 1.0:  # beyond the last probe: never extrapolate downwards
            slope = (values[i + 1] - values[i]).clamp(min=0)
            return values[i + 1] + (frac - 1.0) * slope
        return values[i] + frac * (values[i + 1] - values[i])

    def drafted_seconds(self, R: int, batch_tokens: torch.Tensor) -> torch.Tensor:
        """Seconds of a drafted step of R requests at `batch_tokens` (any shape, ≥ R)."""
        row = self._along_r(self._ms, float(R))  # [nt] ms at this R
        t = (torch.as_tensor(batch_tokens, dtype=torch.float64) / float(R)).clamp(float(self._t[0]), float(self._t[-1]))
        idx = (torch.searchsorted(self._t, t, right=True) - 1).clamp(0, max(len(self._t) - 2, 0))
        if len(self._t) == 1:
            return row[0].expand_as(t) / 1000.0
        lo, hi = self._t[idx], self._t[idx + 1]
        frac = ((t - lo) / (hi - lo)).clamp(0.0, 1.0)
        return (row[idx] + frac * (row[idx + 1] - row[idx])) / 1000.0

    def plain_seconds(self, R: int) -> float | None:
        if self.plain_ms is None:
            return None
        return float(self._along_r(torch.tensor(self.plain_ms, dtype=torch.float64), float(R))) / 1000.0

    def to_json(self) -> dict[str, Any]:
        """Every cost unrounded: a table read back prices steps exactly as the one that was written
        (a cached machine table and the run that profiled it plan alike, near ties included)."""
        d: dict[str, Any] = {"requests": self.requests, "tokens_per_request": self.tokens,
                             "step_ms": [[float(v) for v in row] for row in self.step_ms], "verify": self.verify}
        if self.plain_ms is not None:
            d["plain_ms"] = [float(v) for v in self.plain_ms]
        return d


def _ms(v: Any, source: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not 1000.0 / MAX_STEPS_PER_SEC <= v <= 1000.0 / MIN_STEPS_PER_SEC:
        raise InputError(f"{source}: step time {v!r} ms is not a positive finite number",
                         "profile again with `dsparkctl profile-sps`")
    return float(v)


def _clip(xs: Any) -> str:
    text = repr(xs)
    return text if len(text) <= 60 else text[:57] + "..."


def _whole(v: Any) -> bool:
    """An integer, or a float holding one (JSON writers may print 8.0); never a bool or a string."""
    return (not isinstance(v, bool) and isinstance(v, (int, float))
            and (isinstance(v, int) or (math.isfinite(v) and v == int(v))))
