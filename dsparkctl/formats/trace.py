"""Round traces: JSON lines written by the engine, read by `calibrate` and `sweep-scheduler`.

Line 1 is a header object with `"format": "dsparkctl-trace/1"` and the run's settings
(target, draft, dataset, temperature, seed, block_size, policy, tool_version, ...).
Every further line is one round of one request:

    request            int   index of the request in the run
    round              int   0-based round number of that request
    block_size         int   γ, drafts proposed this round
    confidence_logits  list[γ floats] | null   raw confidence-head logits c_k (pre-sigmoid)
    verify_length      int   ℓ, drafts sent to the target (0..γ)
    accepted           int   drafts accepted (0..ℓ); the round emitted accepted + 1 tokens
    batch_tokens       int   Σ(1 + ℓ_r) over the batch this round ran in
    draft_ms           float wall time of the draft step for the whole batch
    verify_ms          float wall time of the target verify forward for the whole batch
    budget_capped      bool  ℓ was cut below the policy's choice by the token budget
                             (max new tokens); optional, false when absent (older traces)
    drafted            bool  false when the policy skipped the draft (a plain step: no
                             confidences, ℓ = 0); optional, true when absent

Extra keys are allowed and preserved (forward compatible); these names never change.
The reader is strict: UTF-8 lines of strict JSON (no NaN/Infinity, each key once), integers
within int64, block_size ≤ MAX_BLOCK_SIZE, and each (request, round) once per file.
`write_synthetic_trace` writes traces of a known acceptance model (`math.synthetic`) for tests,
benchmarks and the docs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from dsparkctl.errors import InputError
from dsparkctl.files.atomic import atomic_open
from dsparkctl.math.synthetic import SyntheticModel, sample_rounds
from dsparkctl.strict_json import StrictJSONError, finite, loads

TRACE_FORMAT = "dsparkctl-trace/1"
MAX_BLOCK_SIZE = 256  # drafts per round; real DSpark/DFlash blocks are 4-16
_INT_LIMIT = 2 ** 63  # rounds become int64 tensors
_WRITTEN_BY = "traces are written by `dsparkctl generate --trace`"


@dataclass(frozen=True)
class TraceRound:
    request: int
    round: int
    block_size: int
    confidence_logits: list[float] | None
    verify_length: int
    accepted: int
    batch_tokens: int
    draft_ms: float
    verify_ms: float
    budget_capped: bool = False  # ℓ shortened by the token budget, not chosen by the policy
    drafted: bool = True  # False: a plain step the policy chose (no draft ran)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        if d["drafted"]:  # written only for plain steps: older readers keep it as an extra key
            del d["drafted"]
        d.update(extra)
        return d


_INT_FIELDS = ("request", "round", "block_size", "verify_length", "accepted", "batch_tokens")
_FLOAT_FIELDS = ("draft_ms", "verify_ms")


def _parse_round(obj: Any, where: str) -> TraceRound:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}", _WRITTEN_BY)
    missing = [k for k in (*_INT_FIELDS, *_FLOAT_FIELDS, "confidence_logits") if k not in obj]
    if missing:
        raise InputError(f"{where}: missing field(s) {', '.join(missing)}", _WRITTEN_BY)
    for k in _INT_FIELDS:
        v = obj[k]
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _INT_LIMIT:
            raise InputError(f"{where}: field {k!r} must be an integer in [0, 2^63), got {_short(v)}", _WRITTEN_BY)
    for k in _FLOAT_FIELDS:
        v = obj[k]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise InputError(f"{where}: field {k!r} must be a non-negative number, got {_short(v)}", _WRITTEN_BY)
    gamma, ell, acc = obj["block_size"], obj["verify_length"], obj["accepted"]
    if not 1 <= gamma <= MAX_BLOCK_SIZE:
        raise InputError(f"{where}: block_size must be in [1, {MAX_BLOCK_SIZE}], got {gamma}", _WRITTEN_BY)
    if ell > gamma:
        raise InputError(f"{where}: verify_length {ell} exceeds block_size {gamma}", _WRITTEN_BY)
    if acc > ell:
        raise InputError(f"{where}: accepted {acc} exceeds verify_length {ell}", _WRITTEN_BY)
    capped, drafted = obj.get("budget_capped", False), obj.get("drafted", True)
    for k, v in (("budget_capped", capped), ("drafted", drafted)):
        if not isinstance(v, bool):
            raise InputError(f"{where}: field {k!r} must be true or false, got {_short(v)}", _WRITTEN_BY)
    if not drafted and (ell != 0 or obj["confidence_logits"] is not None):
        raise InputError(f"{where}: a round without a draft must have verify_length 0 and no confidence_logits",
                         _WRITTEN_BY)
    logits = obj["confidence_logits"]
    if logits is not None:
        if (not isinstance(logits, list) or len(logits) != gamma
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                           and math.isfinite(x) for x in logits)):
            raise InputError(f"{where}: confidence_logits must be null or {gamma} finite numbers", _WRITTEN_BY)
        logits = [float(x) for x in logits]
    known = {*_INT_FIELDS, *_FLOAT_FIELDS, "confidence_logits", "budget_capped", "drafted"}
    return TraceRound(
        **{k: obj[k] for k in _INT_FIELDS},
        confidence_logits=logits,
        draft_ms=float(obj["draft_ms"]),
        verify_ms=float(obj["verify_ms"]),
        budget_capped=capped,
        drafted=drafted,
        extra={k: v for k, v in obj.items() if k not in known},
    )


def _short(v: Any) -> str:
    """A value for a one-line message: repr, cut to 40 characters (10**30 has 31 digits)."""
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class Trace:
    header: dict[str, Any]
    rounds: list[TraceRound]
    path: str | None = None


def read_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace file; errors name the file and the 1-based line number."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"trace file {path} does not exist", _WRITTEN_BY)
    if not path.is_file():
        raise InputError(f"trace file {path} is not a regular file", _WRITTEN_BY)
    rounds: list[TraceRound] = []
    header: dict[str, Any] | None = None
    seen: dict[tuple[int, int], int] = {}  # (request, round) -> line
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{where}: not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})",
                                 _WRITTEN_BY) from None
            if not line.strip():
                continue
            try:
                obj = loads(line)
            except StrictJSONError as exc:
                raise InputError(f"{where}: {exc}", _WRITTEN_BY) from None
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not valid JSON ({exc.msg})", _WRITTEN_BY) from None
            if header is None:
                if not isinstance(obj, dict) or obj.get("format") != TRACE_FORMAT:
                    raise InputError(f"{where}: first line is not a {TRACE_FORMAT} header", _WRITTEN_BY)
                header = obj
                continue
            r = _parse_round(obj, where)
            first = seen.setdefault((r.request, r.round), lineno)
            if first != lineno:
                raise InputError(f"{where}: request {r.request} round {r.round} is already on line {first}",
                                 "each round is recorded once; remove the duplicated lines")
            rounds.append(r)
    if header is None:
        raise InputError(f"trace file {path} is empty", "record one with `dsparkctl generate --trace`")
    return Trace(header=header, rounds=rounds, path=str(path))


@dataclass
class RoundCounts:
    """What a trace's rounds can be used for: `calibrate` fits on drafted rounds that verified a draft,
    `sweep-scheduler` replays drafted rounds that verified all γ drafts (or were cut by the token budget)."""
    rounds: int = 0
    drafted: int = 0  # rounds that ran the draft (the rest are plain steps the policy chose)
    verified: int = 0  # drafted rounds that verified at least one draft
    full: int = 0  # drafted rounds that verified all γ drafts
    capped: int = 0  # drafted rounds whose ℓ the token budget cut

    def add(self, rounds: Iterable[TraceRound]) -> "RoundCounts":
        for r in rounds:
            self.rounds += 1
            if r.drafted:
                self.drafted += 1
                self.verified += r.verify_length > 0
                self.full += r.verify_length == r.block_size
                self.capped += r.budget_capped and r.verify_length < r.block_size
        return self

    @property
    def short(self) -> int:
        """Drafted rounds in which the policy verified fewer than γ drafts (the budget aside)."""
        return self.drafted - self.full - self.capped


def recording_hint(header: dict[str, Any], path: str | os.PathLike | None) -> str:
    """How to record a trace that `calibrate` and `sweep-scheduler` can use: every position verified."""
    gamma = header.get("block_size")
    policy = f"static:{gamma}" if isinstance(gamma, int) and not isinstance(gamma, bool) else "static:γ"
    return (f"record with `dsparkctl generate --policy {policy} --trace {path or 'FILE'}` (every position "
            "verified; generate's choice for --trace without --policy)")


def recording_fix(counts: RoundCounts, header: dict[str, Any], path: str | os.PathLike | None) -> str:
    """The fix for a trace described by `describe_rounds`: longer requests for one without rounds, else
    `recording_hint`."""
    if not counts.rounds:
        return f"record with `dsparkctl generate --trace {path or 'FILE'} --max-new-tokens N`, N ≥ 2 (e.g. 128)"
    return recording_hint(header, path)


def describe_rounds(counts: RoundCounts, header: dict[str, Any], path: str | os.PathLike | None) -> str:
    """Why a trace holds nothing a tuning command can use, in one clause naming the file, its rounds and
    the policy that recorded them (from the header)."""
    policy = header.get("policy")
    by = f"policy {policy}" if isinstance(policy, str) else "a policy its header does not name"
    if not counts.rounds:
        why = (": it was recorded with max_new_tokens 1, and a request's first token comes from the prefill"
               if header.get("max_new_tokens") == 1 else " (every request ended at its first token, which comes "
               "from the prefill)")
        return f"{path} holds no rounds{why}"
    if not counts.drafted:
        what = "never drafts" if policy == "static:0" else "skipped the draft in every step"
        return f"{path} holds {counts.rounds} rounds, none drafted: it was recorded with {by}, which {what}"
    plain = counts.rounds - counts.drafted
    parts = [f"{counts.drafted} drafted"] + ([f"{plain} without a draft"] if plain else [])
    if not counts.verified:
        return (f"{path} holds {counts.rounds} rounds ({', '.join(parts)}) and none verified a draft: it was "
                f"recorded with {by}")
    if counts.short:
        parts.append(f"{counts.short} drafted verifying fewer than {header.get('block_size', 'γ')} drafts")
    if counts.capped:
        parts.append(f"{counts.capped} budget-capped (cut short by the token budget)")
    return f"{path} holds {counts.rounds} rounds ({', '.join(parts)}): it was recorded with {by}"


def read_traces(paths: Sequence[str | os.PathLike]) -> list[Trace]:
    """Read several traces; the same file twice would duplicate every round, so it is refused."""
    seen: dict[Path, str] = {}
    for p in paths:
        key = Path(p).resolve()
        if key in seen:
            raise InputError(f"trace {p} is given twice (also as {seen[key]})", "pass each trace once")
        seen[key] = str(p)
    return [read_trace(p) for p in paths]


@dataclass
class RoundTable:
    """The drafted rounds of one or more traces as tensors, one row a round (plain steps, which ran
    no draft, are counted and left out): what calibration fits on and the sweep replays."""
    logits: torch.Tensor  # [N, γ] float64 confidence logits (NaN rows where a round has none)
    verify_length: torch.Tensor  # [N]
    accepted: torch.Tensor  # [N]
    request: torch.Tensor  # [N] a dense key per (trace, request): rounds of one request share it
    budget_capped: torch.Tensor  # [N] bool: ℓ cut by the token budget, not chosen by the policy
    gamma: int | None  # the block size (None: no rounds at all)
    where: list[tuple[str | None, int, int]]  # (trace path, request, round) of each row, for messages
    plain_steps: int = 0

    @property
    def has_confidence(self) -> bool:
        return not bool(torch.isnan(self.logits).any())

    def first_without_confidence(self) -> tuple[str | None, int, int] | None:
        missing = torch.isnan(self.logits).any(dim=1).nonzero()
        return self.where[int(missing[0])] if missing.numel() else None


def round_table(traces: Sequence[Trace], purpose: str) -> RoundTable:
    """Every drafted round of `traces` as tensors; refuses traces that mix block sizes (`purpose`
    names what the caller does with them, for the hint: "calibrate", "sweep")."""
    logits, ell, acc, keys, capped, where = [], [], [], [], [], []
    ids: dict[tuple[int, int], int] = {}  # (trace, request) -> dense request key
    gamma, plain = None, 0
    for ti, t in enumerate(traces):
        for r in t.rounds:
            if gamma is None:
                gamma = r.block_size
            elif r.block_size != gamma:
                raise InputError(f"{t.path}: block size {r.block_size} differs from {gamma} in earlier rounds",
                                 f"{purpose} traces of one block size at a time")
            if not r.drafted:
                plain += 1
                continue
            logits.append(r.confidence_logits if r.confidence_logits is not None else [math.nan] * r.block_size)
            ell.append(r.verify_length)
            acc.append(r.accepted)
            keys.append(ids.setdefault((ti, r.request), len(ids)))
            capped.append(r.budget_capped)
            where.append((t.path, r.request, r.round))
    return RoundTable(torch.tensor(logits, dtype=torch.float64).reshape(len(logits), gamma or 0),
                      torch.tensor(ell, dtype=torch.long), torch.tensor(acc, dtype=torch.long),
                      torch.tensor(keys, dtype=torch.long), torch.tensor(capped, dtype=torch.bool), gamma, where,
                      plain)


class TraceWriter:
    """A context manager writing a trace atomically: the file appears only if the block succeeds.
    Under torchrun rank 0 alone writes it (`files.atomic.atomic_open`); every rank may call `write`."""

    def __init__(self, path: str | os.PathLike, header: dict[str, Any]):
        self.counts = RoundCounts()  # what the written rounds can be used for
        self._cm = atomic_open(path, "w")
        self._fh = self._cm.__enter__()
        self._fh.write(json.dumps(finite({"format": TRACE_FORMAT, **header})) + "\n")

    def write(self, rounds: Iterable[TraceRound]) -> None:
        for r in rounds:  # strict JSON: a NaN logit becomes null (and the reader names the line)
            self.counts.add([r])
            self._fh.write(json.dumps(finite(r.to_json())) + "\n")

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, et, ev, tb) -> None:
        self._cm.__exit__(et, ev, tb)  # on an exception the temporary file is removed and it propagates


def write_synthetic_trace(path: str | os.PathLike, model: SyntheticModel, requests: int, rounds_per_request: int,
                          seed: int = 0, batch_size: int = 8, verify_length: int | None = None,
                          with_confidence: bool = True, extra_header: dict | None = None) -> int:
    """A trace of `requests` × `rounds_per_request` rounds drawn from `model`; returns the rounds written."""
    gen = torch.Generator().manual_seed(seed)
    n = requests * rounds_per_request
    s = sample_rounds(model, n, gen, verify_length)
    ell = verify_length if verify_length is not None else model.gamma
    header = {"source": "synthetic", "synthetic_model": asdict(model), "seed": seed,
              "block_size": model.gamma, "policy": f"static:{ell}", "temperature": 1.0,
              **(extra_header or {})}
    logits, acc, vl = s["logits"].tolist(), s["accepted"].tolist(), s["verify_length"].tolist()
    with TraceWriter(path, header) as w:
        w.write(TraceRound(request=i // rounds_per_request, round=i % rounds_per_request,
                           block_size=model.gamma,
                           confidence_logits=[round(x, 6) for x in logits[i]] if with_confidence else None,
                           verify_length=vl[i], accepted=acc[i],
                           batch_tokens=batch_size * (1 + vl[i]), draft_ms=1.0, verify_ms=5.0)
                for i in range(n))
    return n
