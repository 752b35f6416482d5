"""Round traces: JSON lines written by the engine, read by `calibrate` and `sweep-scheduler`.

Line 1 is a header object with `"format": "dsparkctl-trace/1"`, a random `run_id` (traces written
before it have none and read as before) and the run's settings (target, draft, draft_fingerprint,
dataset, temperature, seed, block_size, policy, tool_version, ...).
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
    proposer           str   "lookup" when the row verified a block copied from the context
                             instead of the draft's (no confidences); optional, the draft's when
                             absent. `generate --trace` runs without lookup, so its traces hold none
    sibling_taken      bool  the chain lost x1 and the round emitted a sibling of it: verify_length
                             and accepted stay the chain's, the round emitted accepted + 2 tokens;
                             optional, false when absent (traces run without siblings)

Extra keys are allowed and preserved (forward compatible); these names never change.
The reader is strict: UTF-8 lines of strict JSON (no NaN/Infinity, each key once), integers
within int64, block_size ≤ MAX_BLOCK_SIZE, and each (request, round) once per file. `read_trace`
gives objects (small traces, tests); the commands stream columns (`formats.trace_scan`).
`write_synthetic_trace` writes traces of a known acceptance model (`math.synthetic`) for tests,
benchmarks and the docs.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from dsparkctl.errors import InputError
from dsparkctl.files.atomic import atomic_open
from dsparkctl.math.synthetic import SyntheticModel, sample_rounds
from dsparkctl.strict_json import StrictJSONError, finite, loads

TRACE_FORMAT = "dsparkctl-trace/1"
MAX_BLOCK_SIZE = 256  # drafts per round; real DSpark/DFlash blocks are 4-16
_INT_LIMIT = 2 ** 63  # rounds become int64 tensors
_WRITTEN_BY = "traces are written by `dsparkctl generate --trace`"
REPEATED_ROUND_HINT = "each round is recorded once; remove the duplicated lines"


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


def check_round(obj: Any, where: str) -> tuple[int, int, int, list[float] | None, int, int, bool, bool]:
    """One parsed round line validated: (request, round, block_size, confidence_logits, verify_length,
    accepted, budget_capped, drafted); `where` ("path:line") starts every message. The one check of
    a round, whichever reader holds it (`read_trace` as objects, `formats.trace_scan` as columns)."""
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
    return obj["request"], obj["round"], gamma, logits, ell, acc, capped, drafted


_KNOWN = {*_INT_FIELDS, *_FLOAT_FIELDS, "confidence_logits", "budget_capped", "drafted"}


def _parse_round(obj: Any, where: str) -> TraceRound:
    request, rnd, gamma, logits, ell, acc, capped, drafted = check_round(obj, where)
    return TraceRound(request=request, round=rnd, block_size=gamma, confidence_logits=logits, verify_length=ell,
                      accepted=acc, batch_tokens=obj["batch_tokens"], draft_ms=float(obj["draft_ms"]),
                      verify_ms=float(obj["verify_ms"]), budget_capped=capped, drafted=drafted,
                      extra={k: v for k, v in obj.items() if k not in _KNOWN})


def _short(v: Any) -> str:
    """A value for a one-line message: repr, cut to 40 characters (10**30 has 31 digits)."""
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class Trace:
    header: dict[str, Any]
    rounds: list[TraceRound]
    path: str | None = None


def _other_document(path: Path, limit: int = 64 << 20) -> str | None:
    """What a whole-file JSON document given as a trace is ("a dsparkctl-sps/1 document"), if it says."""
    try:
        if path.stat().st_size > limit:
            return None
        doc = loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(doc, dict) and isinstance(doc.get("format"), str):
        return f"a {doc['format'][:60]!r} document"
    return "a JSON document" if isinstance(doc, (dict, list)) else None


def trace_lines(path: str | os.PathLike, on_bytes: Callable[[int], None] | None = None
                ) -> Iterator[tuple[int, dict[str, Any] | Any]]:
    """(line number, parsed JSON) of every non-blank line of the trace at `path`, read one line at a
    time; the first is the header (checked here). Errors name the file and the 1-based line number.
    `on_bytes(n)` is told every 65536 lines how many bytes were read so far (a progress bar's count)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"trace file {path} does not exist", _WRITTEN_BY)
    if not path.is_file():
        raise InputError(f"trace file {path} is not a regular file", _WRITTEN_BY)
    header, done = None, 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            done += len(raw)
            if on_bytes is not None and not lineno & 0xFFFF:
                on_bytes(done)
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
                if header is None and (kind := _other_document(path)) is not None:
                    raise InputError(f"{path} is {kind}, not a trace", _WRITTEN_BY) from None
                raise InputError(f"{where}: not valid JSON ({exc.msg})", _WRITTEN_BY) from None
            if header is None:
                if not isinstance(obj, dict) or obj.get("format") != TRACE_FORMAT:
                    kind = f"a {obj['format'][:60]!r} document" if isinstance(obj, dict) and isinstance(
                        obj.get("format"), str) else None
                    raise InputError(f"{path} is {kind}, not a trace" if kind else
                                     f"{where}: first line is not a {TRACE_FORMAT} header", _WRITTEN_BY)
                header = obj
            yield lineno, obj
    if on_bytes is not None:
        on_bytes(done)
    if header is None:
        raise InputError(f"trace file {path} is empty", "record one with `dsparkctl generate --trace`")


def read_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a small trace as objects (about 2 KB of Python objects a round: the
    commands read traces as columns, `formats.trace_scan`); errors name the file and line."""
    rounds: list[TraceRound] = []
    header: dict[str, Any] | None = None
    seen: dict[tuple[int, int], int] = {}  # (request, round) -> line
    for lineno, obj in trace_lines(path):
        if header is None:
            header = obj
            continue
        r = _parse_round(obj, f"{path}:{lineno}")
        first = seen.setdefault((r.request, r.round), lineno)
        if first != lineno:
            raise InputError(f"{path}:{lineno}: request {r.request} round {r.round} is already on line {first}",
                             REPEATED_ROUND_HINT)
        rounds.append(r)
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


def new_run_id() -> str:
    """A random identity for one recorded run (the header's `run_id`): two inputs carrying the same
    one are the same run twice, whatever their names (a copy, a link)."""
    return secrets.token_hex(8)


class TraceWriter:
    """A context manager writing a trace atomically: the file appears only if the block succeeds.
    Under torchrun rank 0 alone writes it (`files.atomic.atomic_open`); every rank may call `write`."""

    def __init__(self, path: str | os.PathLike, header: dict[str, Any]):
        self.counts = RoundCounts()  # what the written rounds can be used for
        self._cm = atomic_open(path, "w")
        self._fh = self._cm.__enter__()
        header = {"format": TRACE_FORMAT, "run_id": new_run_id(), **header}  # the caller's run_id wins
        self._fh.write(json.dumps(finite(header)) + "\n")

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
    with TraceWriter(path, header) as w:
        for lo in range(0, n, 8192):  # Python objects for one chunk at a time: a big trace streams
            hi = min(n, lo + 8192)
            logits, acc, vl = (s["logits"][lo:hi].tolist(), s["accepted"][lo:hi].tolist(),
                               s["verify_length"][lo:hi].tolist())
            w.write(TraceRound(request=i // rounds_per_request, round=i % rounds_per_request,
                               block_size=model.gamma,
                               confidence_logits=[round(x, 6) for x in logits[i - lo]] if with_confidence else None,
                               verify_length=vl[i - lo], accepted=acc[i - lo],
                               batch_tokens=batch_size * (1 + vl[i - lo]), draft_ms=1.0, verify_ms=5.0)
                    for i in range(lo, hi))
    return n
