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
Reading and writing table files (ours and SGLang's) is `dsparkctl.sps_io`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from dsparkctl.errors import InputError, UsageError

LOOKUP_MODES = ("floor", "linear")
EXTRAPOLATION = ("clamp", "linear", "error")
MAX_BATCH_TOKENS = 2 ** 31 - 1  # tokens in one forward step; far beyond any engine
MIN_STEPS_PER_SEC, MAX_STEPS_PER_SEC = 1e-6, 1e9  # a step of 11 days or under a nanosecond is a unit error


class SPSTable:
    """A validated SPS table with vectorised lookup.

    batch_tokens   strictly increasing positive ints (probes)
    steps_per_sec  positive finite floats, one per probe
    meta           free-form extra fields (device, dtype, model, provenance, ...), saved as-is
    mode           lookup mode, one of LOOKUP_MODES
    extrapolate    policy beyond the last probe, one of EXTRAPOLATION
    max_batch_tokens  largest batch the engine serves (≥ last probe; default the last probe)
    """

    def __init__(self, batch_tokens: Sequence[int], steps_per_sec: Sequence[float],
                 meta: dict[str, Any] | None = None, *, mode: str = "floor",
                 extrapolate: str = "clamp", max_batch_tokens: int | None = None,
                 source: str = "SPS table"):
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
