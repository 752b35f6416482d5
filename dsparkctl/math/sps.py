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
from dsparkctl.math.step_grid import (MAX_BATCH_TOKENS, MAX_STEPS_PER_SEC, MIN_STEPS_PER_SEC,  # noqa: F401
                                      VERIFY_LAYOUTS, StepGrid, _clip, _whole, fit_step_grid, isotonic)

LOOKUP_MODES = ("floor", "linear")
EXTRAPOLATION = ("clamp", "linear", "error")


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


def check_table_for(spec: str, sps: SPSTable) -> None:
    """Refuse a one-probe table for a policy that plans with step costs (before the policy is built,
    too: `engine/policy_choice.plan_policy`)."""
    if len(sps.batch_tokens) < 2:
        raise UsageError(f"policy {spec!r}: the SPS table has one probe, which SGLang treats as uninitialised "
                         "(it then verifies every draft)", "profile at least two batch-token counts")
