"""Steps-per-second (SPS) tables: how many engine forward steps per second at B batch tokens.

A table is a list of probes `(batch_tokens_i, steps_per_sec_i)`, batch tokens strictly
increasing. The scheduler's throughput is `Θ = τ* · SPS(B)` with `B = Σ_r (1 + ℓ_r)`.

Lookup modes
    floor    SPS of the largest probe ≤ B (SGLang's `bisect_right - 1`); a real SPS curve is a
             staircase (CUDA-graph sizes, kernel switches), so this is the default.
    linear   linear interpolation between the two probes around B.
Below the first probe both modes return the first probe's value (as SGLang does).

Extrapolation policy (B beyond the last probe)
    clamp    hold the last probe's SPS (SGLang's behaviour; optimistic for large B).
    linear   extrapolate step time 1/SPS linearly through the last two probes (compute-bound
             regime); falls back to clamp with a single probe, and where the step time falls
             between the last two probes (it would reach zero: SPS without bound).
    error    raise: the table does not cover this batch.

Probes are bounded: batch tokens ≤ MAX_BATCH_TOKENS, steps/s in [MIN_STEPS_PER_SEC,
MAX_STEPS_PER_SEC], so every lookup and every Θ computed from a table is finite and positive.
Reading and writing table files (ours and SGLang's) is `dsparkctl.formats.sps`.

Step grid and the plain step (`StepGrid`, what `profile-sps` measures since table format 2).
A 1-D table in B cannot tell 8 requests verifying nothing (8 drafts, 8 tokens) from 2 requests
verifying 3 drafts each (2 drafts, 8 tokens), and it has no entry for a step WITHOUT a draft.
The grid keeps what was measured: the whole drafted step's time at R requests × t tokens per
request (t = 1 + drafts verified), and the plain step's time (the target's forward over one
token per request, no draft) at each R. Both are fitted monotone: step time never falls when
requests or tokens grow (`fit_step_grid`, isotonic least squares): more work cannot take less
time, and a raw probe that says otherwise is noise (profile-sps keeps the raw probes beside
the fit and names the ones that contradict it beyond their spread). Lookups interpolate linearly in R and in t = B / R between probes
(clamped to the profiled tokens per request; beyond the largest R, step time is extended through
the last two R probes with a slope ≥ 0). `SPSTable.step_seconds(R, B)` uses the grid when the
table has one and 1 / SPS(B) otherwise; `SPSTable.plain_seconds(R)` is None without a grid.

Beyond the measured range. A profile measured batches up to its last probe (`measured_tokens`,
the same in our table and in the SGLang twin written beside it). A step past it is priced by one
rule for every table, grid or not (`SPSTable.beyond_seconds`: step time extended linearly through
the last two probes), so the twins of one profile agree where neither measured; the sweep counts
such steps (`beyond_profile`). The lookup modes above (`sps`, SGLang's own planner) keep "clamp".

Verify layout. dsparkctl's engine verifies a step as one `[R, 1 + max ℓ]` rectangle (a batched
forward pads the shorter rows), so a step where one request verifies 4 drafts and seven verify
none costs what 8 × 5 tokens cost, not 8 + 4. A grid records this (`verify: "padded"`, the
default) and `SPSTable.lengths_seconds(ℓ)` prices a step from its lengths accordingly; an engine
that packs ragged rows is `verify: "ragged"` (Σ(1 + ℓ) batch tokens), as is every 1-D table.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from dsparkctl.errors import InputError, UsageError

LOOKUP_MODES = ("floor", "linear")
EXTRAPOLATION = ("clamp", "linear", "error")
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


class SPSTable:
    """A validated SPS table with vectorised lookup.

    batch_tokens   strictly increasing positive ints (probes)
    steps_per_sec  positive finite floats, one per probe
    meta           free-form extra fields (device, dtype, model, provenance, ...), saved as-is
    mode           lookup mode, one of LOOKUP_MODES
    extrapolate    policy beyond the last probe, one of EXTRAPOLATION
    max_batch_tokens  largest batch the engine serves (≥ last probe; default the last probe)
    grid           a `StepGrid` (requests × tokens, and the plain step) when profiled with one
    """

    def __init__(self, batch_tokens: Sequence[int], steps_per_sec: Sequence[float],
                 meta: dict[str, Any] | None = None, *, mode: str = "floor",
                 extrapolate: str = "clamp", max_batch_tokens: int | None = None,
                 source: str = "SPS table", grid: StepGrid | None = None):
        bt, sps = list(batch_tokens), list(steps_per_sec)
        if not bt:
            raise InputError(f"{source}: has no probes", "a table needs at least one (batch tokens, steps/s) probe")
        if len(bt) != len(sps):
            raise InputError(f"{source}: {len(bt)} batch_tokens but {len(sps)} steps_per_sec values",
                             "every probe needs one batch size and one steps/s value")
        for i, b in enumerate(bt):
            if not _whole(b) or not 1 <= b <= MAX_BATCH_TOKENS:
                raise InputError(f"{source}: batch_tokens[{i}] = {b!r} is not a positive integer "
                                 f"(at most {MAX_BATCH_TOKENS})",
                                 "batch tokens count tokens in one forward, so they are integers ≥ 1")
        bt = [int(b) for b in bt]
        for i in range(1, len(bt)):
            if bt[i] <= bt[i - 1]:
                raise InputError(
                    f"{source}: batch_tokens not strictly increasing at index {i} "
                    f"({bt[i - 1]} then {bt[i]})",
                    "sort the probes by batch tokens and merge duplicates (median of repeats)")
        for i, s in enumerate(sps):
            if (isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s)
                    or not MIN_STEPS_PER_SEC <= s <= MAX_STEPS_PER_SEC):
                raise InputError(f"{source}: steps_per_sec[{i}] = {s!r} is not a positive finite number in "
                                 f"[{MIN_STEPS_PER_SEC:g}, {MAX_STEPS_PER_SEC:g}]",
                                 "re-profile the table; steps per second, not per millisecond or per hour")
        if mode not in LOOKUP_MODES:
            raise UsageError(f"unknown SPS lookup mode {mode!r}", f"use one of {', '.join(LOOKUP_MODES)}")
        if extrapolate not in EXTRAPOLATION:
            raise UsageError(f"unknown SPS extrapolation policy {extrapolate!r}",
                             f"use one of {', '.join(EXTRAPOLATION)}")
        if max_batch_tokens is not None and (not _whole(max_batch_tokens)
                                             or max_batch_tokens > MAX_BATCH_TOKENS):
            raise InputError(f"{source}: max_batch_tokens {max_batch_tokens!r} is not an integer ≤ {MAX_BATCH_TOKENS}",
                             "max_batch_tokens is the largest batch (in tokens) the engine serves")
        mbt = bt[-1] if max_batch_tokens is None else int(max_batch_tokens)
        if mbt < bt[-1]:
            raise InputError(f"{source}: max_batch_tokens {mbt} is below the last probe {bt[-1]}",
                             "max_batch_tokens must be ≥ every probe")
        self.batch_tokens: list[int] = bt
        self.steps_per_sec: list[float] = [float(s) for s in sps]
        self.meta: dict[str, Any] = dict(meta or {})
        self.mode = mode
        self.extrapolate = extrapolate
        self.max_batch_tokens = mbt
        self.source = source
        self._x = torch.tensor(bt, dtype=torch.float64)  # [P]
        self._y = torch.tensor(self.steps_per_sec, dtype=torch.float64)  # [P]
        self._dense: torch.Tensor | None = None  # [N+1] SPS at integer B = 0..N (cache)
        self.grid = grid
        self._step_cache: dict[tuple[int, int], torch.Tensor] = {}

    # ---------------------------------------------------------------- step costs
    @property
    def has_plain(self) -> bool:
        """Whether the table knows what a step WITHOUT a draft costs (grid with plain_ms)."""
        return self.grid is not None and self.grid.plain_ms is not None

    @property
    def measured_tokens(self) -> int:
        """The largest batch (tokens) the profile measured: its last probe, the same in our table and
        its SGLang twin (written from one profile). Beyond it a step is priced by `beyond_seconds`."""
        return self.batch_tokens[-1]

    @property
    def _twin_rule(self) -> bool:
        """Whether steps past the measured range follow `beyond_seconds`: always without a grid; with
        one when the 1-D probes end where the grid does (a profile-sps table: its twin holds the same
        probes). A hand-built table whose probes do not describe its grid keeps the grid's own extension."""
        g = self.grid
        return g is None or g.requests[-1] * g.tokens[-1] == self.measured_tokens

    def beyond_seconds(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        """Seconds of drafted steps at `batch_tokens` (any shape) past the measured range: the step
        time extended linearly through the last two probes (slope ≥ 0; held with one probe). The
        one rule for every table, so the twins of one profile price a step beyond it alike; never
        the lookup's "clamp", which would price a batch 100× the last probe at one probe's step.
        A table that says "extrapolate": "error" refuses."""
        b = torch.as_tensor(batch_tokens, dtype=torch.float64)
        x, y = self._x, self._y
        if self.extrapolate == "error" and b.numel() and float(b.max()) > float(x[-1]):
            raise InputError(f"{self.source}: batch of {float(b.max()):g} tokens is beyond the table's last "
                             f"probe ({self.batch_tokens[-1]})",
                             "profile larger batches, or set \"extrapolate\": \"linear\" in the table file")
        slope = max(float((1.0 / y[-1] - 1.0 / y[-2]) / (x[-1] - x[-2])), 0.0) if len(x) >= 2 else 0.0
        return 1.0 / y[-1] + slope * (b - x[-1]).clamp(min=0.0)

    def step_seconds(self, requests: int, batch_tokens: torch.Tensor) -> torch.Tensor:
        """Seconds of a drafted step of `requests` requests at `batch_tokens` (any shape): from the
        grid when there is one, else 1 / SPS(B); past the measured range `beyond_seconds`, whichever."""
        b = torch.as_tensor(batch_tokens, dtype=torch.float64)
        top = float(self.measured_tokens)
        inside = (self.grid.drafted_seconds(requests, b) if self.grid is not None
                  else 1.0 / self.sps(b.clamp(max=top)))
        if not b.numel() or float(b.max()) <= top or not self._twin_rule:
            return inside
        return torch.where(b > top, self.beyond_seconds(b), inside)

    @property
    def padded(self) -> bool:
        """Whether a drafted step costs what its LONGEST verify costs for every request (the grid's
        "padded" layout, dsparkctl's engine) rather than Σ(1 + ℓ) batch tokens."""
        return self.grid is not None and self.grid.verify == "padded"

    def step_tokens(self, lengths: torch.Tensor) -> torch.Tensor:
        """Tokens the engine's forward processes for verify lengths `[..., R]` → `[...]` float64:
        R × (1 + max ℓ) padded, Σ(1 + ℓ) ragged."""
        R = lengths.shape[-1]
        if self.padded:
            return (R * (1 + lengths.amax(-1))).to(torch.float64)
        return (lengths + 1).sum(-1).to(torch.float64)

    def lengths_seconds(self, lengths: torch.Tensor) -> torch.Tensor:
        """Seconds of drafted steps with verify lengths `[..., R]` → `[...]`, in the table's layout."""
        return self.step_seconds(lengths.shape[-1], self.step_tokens(lengths))

    def level_curve(self, requests: int, gamma: int) -> torch.Tensor:
        """Seconds of a drafted step where all R requests verify L drafts, L = 0..γ → `[γ + 1]` (cached)."""
        key = (int(requests), -2 - int(gamma))
        got = self._step_cache.get(key)
        if got is None:
            got = self._step_cache[key] = self.step_seconds(
                requests, requests * torch.arange(1, gamma + 2, dtype=torch.float64))
        return got

    def step_curve(self, requests: int, drafts: int) -> torch.Tensor:
        """Seconds of a drafted step at B = R + m for m = 0..drafts `[drafts + 1]` (cached)."""
        key = (int(requests), int(drafts))
        got = self._step_cache.get(key)
        if got is None:
            if len(self._step_cache) > 4096:
                self._step_cache.clear()
            got = self.step_seconds(requests, torch.arange(requests, requests + drafts + 1, dtype=torch.float64))
            self._step_cache[key] = got
        return got

    def plain_seconds(self, requests: int) -> float | None:
        """Seconds of a step without a draft at `requests` requests; None when the table does not say."""
        if self.grid is None:
            return None
        if requests > self.measured_tokens and self._twin_rule:  # past the profile: as its twin prices it
            return float(self.beyond_seconds(torch.tensor(float(requests))))
        key = (int(requests), -1)
        if key not in self._step_cache:
            self._step_cache[key] = self.grid.plain_seconds(requests)
        return self._step_cache[key]

    # ---------------------------------------------------------------- lookup
    def sps(self, batch_tokens: torch.Tensor | Sequence[float] | float,
            mode: str | None = None) -> torch.Tensor:
        """SPS at each batch size. `batch_tokens`: any shape; returns float64, same shape."""
        mode = mode or self.mode
        if mode not in LOOKUP_MODES:
            raise UsageError(f"unknown SPS lookup mode {mode!r}", f"use one of {', '.join(LOOKUP_MODES)}")
        b = torch.as_tensor(batch_tokens, dtype=torch.float64)
        x, y = self._x, self._y
        if self.extrapolate == "error" and b.numel() and float(b.max()) > x[-1]:
            raise InputError(f"{self.source}: batch of {float(b.max()):g} tokens is beyond the table's last probe "
                             f"({self.batch_tokens[-1]})",
                             "profile larger batches, or set \"extrapolate\": \"clamp\" or \"linear\" in the "
                             "table file")
        idx = torch.searchsorted(x, b, right=True) - 1  # floor probe index, -1 below the first
        lo = idx.clamp(0, len(x) - 1)
        if mode == "floor":
            out = y[lo]
        else:
            hi = (lo + 1).clamp(max=len(x) - 1)
            span = (x[hi] - x[lo]).clamp(min=1.0)
            frac = ((b - x[lo]) / span).clamp(0.0, 1.0)
            out = y[lo] + frac * (y[hi] - y[lo])
        if self.extrapolate == "linear" and len(x) >= 2:
            # step time t(B) = 1/SPS extended linearly through the last two probes; a falling step
            # time would reach zero (SPS without bound), so it is held instead (slope ≥ 0).
            t1, t2 = 1.0 / y[-2], 1.0 / y[-1]
            slope = max(float((t2 - t1) / (x[-1] - x[-2])), 0.0)
            t = t2 + slope * (b - x[-1])
            beyond = b > x[-1]
            out = torch.where(beyond, 1.0 / t.clamp(min=1e-12), out)
        return out

    def dense(self, upto: int) -> torch.Tensor:
        """SPS at every integer batch size 0..upto as a float64 tensor `[upto+1]` (cached)."""
        if self._dense is None or self._dense.numel() <= upto:
            n = max(int(upto), 2 * (self._dense.numel() if self._dense is not None else 0))
            self._dense = self.sps(torch.arange(n + 1, dtype=torch.float64))
        return self._dense[: upto + 1]

    def __call__(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        return self.sps(batch_tokens)

    def __repr__(self) -> str:
        return (f"SPSTable({len(self.batch_tokens)} probes, B={self.batch_tokens[0]}..{self.batch_tokens[-1]}, "
                f"mode={self.mode}, extrapolate={self.extrapolate})")



def _whole(v: Any) -> bool:
    """An integer, or a float holding one (JSON writers may print 8.0); never a bool or a string."""
    return (not isinstance(v, bool) and isinstance(v, (int, float))
            and (isinstance(v, int) or (math.isfinite(v) and v == int(v))))
