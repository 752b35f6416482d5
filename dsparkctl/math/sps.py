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

Files
    ours    {"format": "dsparkctl-sps/1", "batch_tokens": [...], "steps_per_sec": [...],
             "max_batch_tokens": N, "lookup": "floor", "extrapolate": "clamp",
             "provenance": {...}, ...extra keys preserved in `meta`}
    SGLang  {"sample_batch_tokens": [...], "sample_steps_per_sec": [...], "max_batch_tokens": N}
            (`--speculative-dspark-sps-table-path`; sglang dspark_components/dspark_sps.py
            requires max_batch_tokens ≥ the last probe.)
`SPSTable.load` detects the format from the keys and reads strict JSON (no NaN/Infinity, each key
once). Probes are bounded: batch tokens ≤ MAX_BATCH_TOKENS, steps/s in [MIN_STEPS_PER_SEC,
MAX_STEPS_PER_SEC], so every lookup and every Θ computed from a table is finite and positive.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import torch

from dsparkctl.errors import InputError, UsageError
from dsparkctl.fsutil import write_json
from dsparkctl.provenance import provenance

SPS_FORMAT = "dsparkctl-sps/1"
LOOKUP_MODES = ("floor", "linear")
EXTRAPOLATION = ("clamp", "linear", "error")
MAX_BATCH_TOKENS = 2 ** 31 - 1  # tokens in one forward step; far beyond any engine
MIN_STEPS_PER_SEC, MAX_STEPS_PER_SEC = 1e-6, 1e9  # a step of 11 days or under a nanosecond is a unit error
_PROFILE_HINT = "profile one with `dsparkctl profile-sps`"


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
            raise InputError(f"{source}: has no probes", _PROFILE_HINT)
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
                             "profile larger batches (profile-sps --requests/--tokens-per-request), or set "
                             "\"extrapolate\": \"clamp\" or \"linear\" in the table file")
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

    def with_options(self, mode: str | None = None, extrapolate: str | None = None) -> "SPSTable":
        """A copy with another lookup mode / extrapolation policy."""
        return SPSTable(self.batch_tokens, self.steps_per_sec, self.meta, mode=mode or self.mode,
                        extrapolate=extrapolate or self.extrapolate,
                        max_batch_tokens=self.max_batch_tokens, source=self.source)

    def is_unimodal_friendly(self) -> bool:
        """True when B·SPS(B) (tokens/s of plain decoding) never decreases between probes."""
        prod = self._x * self._y
        return bool((prod[1:] >= prod[:-1]).all())

    def __repr__(self) -> str:
        return (f"SPSTable({len(self.batch_tokens)} probes, B={self.batch_tokens[0]}..{self.batch_tokens[-1]}, "
                f"mode={self.mode}, extrapolate={self.extrapolate})")

    # ------------------------------------------------------------------ files
    def to_json(self, fmt: str = "dsparkctl") -> dict[str, Any]:
        if fmt == "sglang":
            return {"sample_batch_tokens": list(self.batch_tokens),
                    "sample_steps_per_sec": list(self.steps_per_sec),
                    "max_batch_tokens": int(self.max_batch_tokens)}
        if fmt != "dsparkctl":
            raise UsageError(f"unknown SPS table format {fmt!r}", "use dsparkctl or sglang")
        meta = dict(self.meta)
        prov = meta.pop("provenance", None) or provenance()
        return {"format": SPS_FORMAT, "batch_tokens": list(self.batch_tokens),
                "steps_per_sec": list(self.steps_per_sec),
                "max_batch_tokens": int(self.max_batch_tokens), "lookup": self.mode,
                "extrapolate": self.extrapolate, **meta, "provenance": prov}

    def save(self, path: str | os.PathLike, fmt: str = "dsparkctl") -> None:
        """Write atomically, in our format (with provenance) or SGLang's."""
        write_json(path, self.to_json(fmt))

    @classmethod
    def from_json(cls, obj: Any, source: str = "SPS table", mode: str | None = None,
                  extrapolate: str | None = None) -> "SPSTable":
        if not isinstance(obj, dict):
            raise InputError(f"{source}: expected a JSON object", "pass an SPS table JSON file")
        if obj.get("format") == SPS_FORMAT:
            known = {"format", "batch_tokens", "steps_per_sec", "max_batch_tokens", "lookup", "extrapolate"}
            for k in ("batch_tokens", "steps_per_sec"):
                if not isinstance(obj.get(k), list):
                    raise InputError(f"{source}: field {k!r} missing or not a list",
                                     "write tables with `dsparkctl profile-sps`")
            for k, choices in (("lookup", LOOKUP_MODES), ("extrapolate", EXTRAPOLATION)):
                if k in obj and obj[k] not in choices:
                    raise InputError(f"{source}: field {k!r} is {obj[k]!r}, not one of {', '.join(choices)}",
                                     f"set \"{k}\": \"{choices[0]}\"")
            return cls(obj["batch_tokens"], obj["steps_per_sec"],
                       meta={k: v for k, v in obj.items() if k not in known},
                       mode=mode or obj.get("lookup", "floor"),
                       extrapolate=extrapolate or obj.get("extrapolate", "clamp"),
                       max_batch_tokens=obj.get("max_batch_tokens"), source=source)
        if "sample_batch_tokens" in obj or "sample_steps_per_sec" in obj:
            for k in ("sample_batch_tokens", "sample_steps_per_sec"):
                if not isinstance(obj.get(k), list):
                    raise InputError(f"{source}: SGLang field {k!r} missing or not a list",
                                     "an SGLang table has sample_batch_tokens and sample_steps_per_sec")
            mbt = obj.get("max_batch_tokens")
            return cls(obj["sample_batch_tokens"], obj["sample_steps_per_sec"],
                       meta={"imported_from": "sglang"}, mode=mode or "floor",
                       extrapolate=extrapolate or "clamp", max_batch_tokens=mbt, source=source)
        if "bias_seconds" in obj:
            raise InputError(f"{source}: SGLang additive step-time tables are not supported",
                             "profile a plain SPS table (sample_batch_tokens / sample_steps_per_sec)")
        raise InputError(f"{source}: not an SPS table (no 'format': '{SPS_FORMAT}' and no "
                         "'sample_batch_tokens')", "pass a file written by `dsparkctl profile-sps`")

    @classmethod
    def load(cls, path: str | os.PathLike, mode: str | None = None,
             extrapolate: str | None = None) -> "SPSTable":
        """Read our JSON or SGLang's (auto-detected). Errors name the file."""
        from dsparkctl.strict_json import read

        obj = read(path, "SPS table", _PROFILE_HINT)
        return cls.from_json(obj, source=str(path), mode=mode, extrapolate=extrapolate)


def _whole(v: Any) -> bool:
    """An integer, or a float holding one (JSON writers may print 8.0); never a bool or a string."""
    return (not isinstance(v, bool) and isinstance(v, (int, float))
            and (isinstance(v, int) or (math.isfinite(v) and v == int(v))))
