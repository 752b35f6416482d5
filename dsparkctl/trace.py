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

Extra keys are allowed and preserved (forward compatible); these names never change.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from dsparkctl.errors import InputError
from dsparkctl.fsutil import atomic_open

TRACE_FORMAT = "dsparkctl-trace/1"


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
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        return d


_INT_FIELDS = ("request", "round", "block_size", "verify_length", "accepted", "batch_tokens")
_FLOAT_FIELDS = ("draft_ms", "verify_ms")


def _parse_round(obj: Any, where: str) -> TraceRound:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in (*_INT_FIELDS, *_FLOAT_FIELDS, "confidence_logits") if k not in obj]
    if missing:
        raise InputError(f"{where}: missing field(s) {', '.join(missing)}",
                         "traces are written by `dsparkctl generate --trace`")
    for k in _INT_FIELDS:
        v = obj[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise InputError(f"{where}: field {k!r} must be a non-negative integer, got {v!r}")
    for k in _FLOAT_FIELDS:
        v = obj[k]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise InputError(f"{where}: field {k!r} must be a non-negative number, got {v!r}")
    gamma, ell, acc = obj["block_size"], obj["verify_length"], obj["accepted"]
    if gamma < 1:
        raise InputError(f"{where}: block_size must be >= 1, got {gamma}")
    if ell > gamma:
        raise InputError(f"{where}: verify_length {ell} exceeds block_size {gamma}")
    if acc > ell:
        raise InputError(f"{where}: accepted {acc} exceeds verify_length {ell}")
    logits = obj["confidence_logits"]
    if logits is not None:
        if (not isinstance(logits, list) or len(logits) != gamma
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                           and math.isfinite(x) for x in logits)):
            raise InputError(f"{where}: confidence_logits must be null or {gamma} finite numbers")
        logits = [float(x) for x in logits]
    known = {*_INT_FIELDS, *_FLOAT_FIELDS, "confidence_logits"}
    return TraceRound(
        **{k: obj[k] for k in _INT_FIELDS},
        confidence_logits=logits,
        draft_ms=float(obj["draft_ms"]),
        verify_ms=float(obj["verify_ms"]),
        extra={k: v for k, v in obj.items() if k not in known},
    )


@dataclass
class Trace:
    header: dict[str, Any]
    rounds: list[TraceRound]
    path: str | None = None


def read_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace file; errors name the file and the 1-based line number."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"trace file {path} does not exist", "pass a file written by `--trace`")
    rounds: list[TraceRound] = []
    header: dict[str, Any] | None = None
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
            if header is None:
                if not isinstance(obj, dict) or obj.get("format") != TRACE_FORMAT:
                    raise InputError(f"{where}: first line is not a {TRACE_FORMAT} header",
                                     "traces are written by `dsparkctl generate --trace`")
                header = obj
                continue
            rounds.append(_parse_round(obj, where))
    if header is None:
        raise InputError(f"trace file {path} is empty", "record one with `dsparkctl generate --trace`")
    return Trace(header=header, rounds=rounds, path=str(path))


class TraceWriter:
    """Writes a trace atomically: the file appears only when `close()` succeeds."""

    def __init__(self, path: str | os.PathLike, header: dict[str, Any]):
        self._cm = atomic_open(path, "w")
        self._fh = self._cm.__enter__()
        self._fh.write(json.dumps({"format": TRACE_FORMAT, **header}) + "\n")

    def write(self, rounds: Iterable[TraceRound]) -> None:
        for r in rounds:
            self._fh.write(json.dumps(r.to_json()) + "\n")

    def close(self) -> None:
        self._cm.__exit__(None, None, None)

    def abort(self, exc: BaseException) -> None:
        try:
            self._cm.__exit__(type(exc), exc, exc.__traceback__)
        except BaseException:
            pass

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, et, ev, tb) -> None:
        if et is None:
            self.close()
        else:
            self.abort(ev)


def iter_request_rounds(trace: Trace) -> Iterator[list[TraceRound]]:
    """Group a trace's rounds by request, each list ordered by round."""
    by_req: dict[int, list[TraceRound]] = {}
    for r in trace.rounds:
        by_req.setdefault(r.request, []).append(r)
    for req in sorted(by_req):
        yield sorted(by_req[req], key=lambda r: r.round)
