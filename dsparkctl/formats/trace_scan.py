"""Traces read at scale, and pooled only when they belong together.

Each file is streamed once, line by line (`formats.trace.trace_lines`, the one strict reader and
`check_round`, the one check of a round), into numpy columns: about 30 bytes a round plus 8 a
confidence logit, where `TraceRound` objects take about 2 KB. Several traces are pooled only if

  one draft     their headers agree on `target` and `draft_fingerprint` (and on `draft`, the
                name, where either lacks a fingerprint): temperatures fitted on two drafts'
                rounds suit neither, and the calibration would be taken for both;
  no repeats    no file is given twice (by path or inode), no run twice (the header's `run_id`),
                no file's rounds twice (a digest of the rounds: a copy with another name or an
                edited header), no request twice (a digest of each request's rounds with
                confidence logits, request number and timings left out: a subset or a
                renumbered copy). Rounds counted twice weigh twice, and a copy's requests land
                on both sides of the held-out split;
  one block size.

The held-out split groups rounds by request identity: (the header's `dataset`, request index)
where the header names its dataset (a prompt recorded in two runs is one request, on one side of
the split), else (the file, request index).
"""

from __future__ import annotations

import json
import math
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dsparkctl.errors import InputError
from dsparkctl.formats.trace import REPEATED_ROUND_HINT, RoundCounts, check_round, trace_lines

IDENTITY_FIELDS = ("target", "draft_fingerprint", "draft")  # what a pooled set of traces must share
Progress = Callable[[int, int], None]  # (bytes read, bytes in all) across the files of one pool


@dataclass
class TraceColumns:
    """One trace file's rounds as columns, in file order (plain steps included)."""
    path: str
    header: dict[str, Any]
    request: np.ndarray  # [n] int64
    round: np.ndarray  # [n] int64
    block_size: np.ndarray  # [n] int16
    verify_length: np.ndarray  # [n] int16
    accepted: np.ndarray  # [n] int16
    budget_capped: np.ndarray  # [n] bool
    drafted: np.ndarray  # [n] bool
    logits: np.ndarray | None  # [Σ block_size] float64, NaN where a round has none (None: not kept)


def scan_trace(path: str | os.PathLike, on_bytes: Callable[[int], None] | None = None,
               keep_logits: bool = True) -> TraceColumns:
    """Read and validate the trace at `path` in one streamed pass; the same checks and messages as
    `read_trace`. `on_bytes(n)`: bytes read so far, now and then."""
    ints = [array("q"), array("q"), array("h"), array("h"), array("h")]  # request, round, γ, ℓ, accepted (≤ 256)
    flags = [array("b"), array("b")]  # budget_capped, drafted
    logits = array("d")
    header: dict[str, Any] | None = None
    try:
        for lineno, obj in trace_lines(path, on_bytes):
            if header is None:
                header = obj
                continue
            request, rnd, gamma, lg, ell, acc, capped, drafted = check_round(obj, f"{path}:{lineno}")
            for col, v in zip(ints, (request, rnd, gamma, ell, acc)):
                col.append(v)
            flags[0].append(capped)
            flags[1].append(drafted)
            if keep_logits:
                logits.extend(lg if lg is not None else (math.nan,) * gamma)
    except InputError:
        _refuse_repeated_rounds(path, ints[0], ints[1])  # a repeat before the broken line is reported first
        raise
    _refuse_repeated_rounds(path, ints[0], ints[1])
    cols = [np.frombuffer(c, dtype=np.int64 if c.typecode == "q" else np.int16) for c in ints]
    return TraceColumns(str(path), header, *cols, np.frombuffer(flags[0], dtype=np.int8).astype(bool),
                        np.frombuffer(flags[1], dtype=np.int8).astype(bool),
                        np.frombuffer(logits, dtype=np.float64) if keep_logits else None)


def _refuse_repeated_rounds(path: str | os.PathLike, request: array, rnd: array) -> None:
    """Each (request, round) once per file: names the first line that repeats an earlier one."""
    req, rd = np.frombuffer(request, dtype=np.int64), np.frombuffer(rnd, dtype=np.int64)
    if req.size < 2:
        return
    order = np.lexsort((rd, req))  # stable: equal rounds keep their file order
    same = (req[order][1:] == req[order][:-1]) & (rd[order][1:] == rd[order][:-1])
    if not same.any():
        return
    later = order[1:][same]  # rows that repeat an earlier one
    k = int(later.min())
    first = int(np.flatnonzero((req == req[k]) & (rd == rd[k]))[0])
    line_of = _round_lines(path, (first, k))
    raise InputError(f"{path}:{line_of[k]}: request {int(req[k])} round {int(rd[k])} is already on line "
                     f"{line_of[first]}", REPEATED_ROUND_HINT)


def _round_lines(path: str | os.PathLike, rows: Sequence[int]) -> dict[int, int]:
    """The line numbers of round rows `rows` (0-based, file order), read again: only an error needs them."""
    want, out = set(rows), {}
    for i, (lineno, _) in enumerate(trace_lines(path)):
        if i - 1 in want:
            out[i - 1] = lineno
            if len(out) == len(want):
                break
    return out


@dataclass
class RoundTable:
    """The drafted rounds of one or more traces as tensors, one row a round (plain steps, which ran
    no draft, are counted and left out): what calibration fits on and the sweep replays."""
    logits: torch.Tensor  # [N, γ] float64 confidence logits (NaN rows where a round has none)
    verify_length: torch.Tensor  # [N] long
    accepted: torch.Tensor  # [N] long
    request: torch.Tensor  # [N] long, a dense key per request identity (module doc): rounds of one request share it
    budget_capped: torch.Tensor  # [N] bool: ℓ cut by the token budget, not chosen by the policy
    gamma: int | None  # the block size (None: no rounds at all)
    source: np.ndarray  # [N] int64 the file of each row (an index into `paths`)
    request_no: np.ndarray  # [N] int64 the request number each row has in its file
    round_no: np.ndarray  # [N] int64
    paths: list[str]
    headers: list[dict[str, Any]]
    plain_steps: int = 0
    counts: list[RoundCounts] = field(default_factory=list)  # per file: what its rounds can be used for

    @property
    def rows(self) -> int:
        return int(self.verify_length.numel())

    def where(self, i: int) -> tuple[str, int, int]:
        """(trace path, request, round) of row `i`, for messages."""
        return self.paths[int(self.source[i])], int(self.request_no[i]), int(self.round_no[i])

    @property
    def has_confidence(self) -> bool:
        return not bool(torch.isnan(self.logits).any())

    def first_without_confidence(self) -> tuple[str, int, int] | None:
        missing = torch.isnan(self.logits).any(dim=1).nonzero()
        return self.where(int(missing[0])) if missing.numel() else None


def read_round_table(paths: Sequence[str | os.PathLike], purpose: str, progress: Progress | None = None
                     ) -> RoundTable:
    """Every drafted round of the traces at `paths`, streamed and pooled (module doc: one draft, no
    repeats, one block size). `purpose` names what the caller does with them, for the hints
    ("calibrate", "sweep"); `progress(done, total)` counts bytes read."""
    _refuse_same_file(paths)
    total = sum(os.stat(p).st_size for p in paths if Path(p).is_file())
    files: list[TraceColumns] = []
    for p in paths:
        base = sum(os.stat(f.path).st_size for f in files)
        files.append(scan_trace(p, (lambda n, base=base: progress(base + n, total)) if progress else None))
    _refuse_other_identity(files, purpose)
    gamma = _one_block_size(files, purpose)
    _refuse_repeats(files, gamma)
    return _table(files, gamma)


def _refuse_same_file(paths: Sequence[str | os.PathLike]) -> None:
    """The same file twice, by path or by inode (a hard link), before anything is read."""
    seen: dict[Any, str] = {}
    for p in paths:
        keys = [Path(p).resolve()]
        if Path(p).is_file():
            st = os.stat(p)
            keys.append((st.st_dev, st.st_ino))
        for key in keys:
            if key in seen:
                raise InputError(f"trace {p} is given twice (also as {seen[key]})", "pass each trace once")
        for key in keys:
            seen[key] = str(p)


def _refuse_other_identity(files: Sequence[TraceColumns], purpose: str) -> None:
    """Every pair of headers agrees on the draft and target they name (module doc)."""
    for i, b in enumerate(files):
        for a in files[:i]:
            for k in IDENTITY_FIELDS:
                if k not in a.header or k not in b.header or _canon(a.header[k]) == _canon(b.header[k]):
                    continue
                if k == "draft" and "draft_fingerprint" in a.header and "draft_fingerprint" in b.header:
                    continue  # one draft at two paths: the fingerprints decide
                raise InputError(f"{b.path} and {a.path} record different runs to pool: {k} {_short(b.header[k])} "
                                 f"vs {_short(a.header[k])}",
                                 f"{purpose} the traces of one draft and target at a time")


def _one_block_size(files: Sequence[TraceColumns], purpose: str) -> int | None:
    gamma = next((int(f.block_size[0]) for f in files if f.block_size.size), None)
    for f in files:
        other = np.flatnonzero(f.block_size != gamma)
        if other.size:
            raise InputError(f"{f.path}: block size {int(f.block_size[other[0]])} differs from {gamma} in earlier "
                             "rounds", f"{purpose} traces of one block size at a time")
    return gamma


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping): a well-spread 64-bit hash."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _request_digests(f: TraceColumns, gamma: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(request numbers `[R]`, digest of each request's rounds `[R]` uint64, whether it can be told
    apart by content `[R]` bool: every drafted round has confidence logits). A digest covers each
    round's number, block size, ℓ, accepted, flags and logits; not the request number or timings."""
    with np.errstate(over="ignore"):
        h = _mix(f.round.astype(np.uint64))
        for col in (f.block_size, f.verify_length, f.accepted, f.budget_capped, f.drafted):
            h = _mix(h ^ col.astype(np.uint64))
        lg = f.logits.reshape(-1, gamma).view(np.uint64)
        for k in range(gamma):
            h = _mix(h ^ lg[:, k])
        requests, inverse = np.unique(f.request, return_inverse=True)
        digest = np.zeros(requests.size, dtype=np.uint64)
        np.add.at(digest, inverse, _mix(h))  # a sum: the rounds' order in the file does not matter
    has = ~np.isnan(f.logits.reshape(-1, gamma)).any(axis=1)
    drafted = np.bincount(inverse, weights=f.drafted, minlength=requests.size)
    told = np.bincount(inverse, weights=f.drafted & has, minlength=requests.size)
    return requests, digest, (drafted > 0) & (told == drafted)


def _refuse_repeats(files: Sequence[TraceColumns], gamma: int | None) -> None:
    """No run, no file's rounds and no request's rounds twice among `files` (module doc)."""
    runs: dict[str, str] = {}
    for f in files:
        rid = f.header.get("run_id")
        if isinstance(rid, str):
            if rid in runs:
                raise InputError(f"{f.path} and {runs[rid]} are the same run (run_id {_short(rid)}): a copy or a "
                                 "link of one trace", "pass each trace once")
            runs[rid] = f.path
    if gamma is None:
        return
    digests = [_request_digests(f, gamma) for f in files]
    whole: dict[tuple[int, int], str] = {}
    for f, (_, d, _) in zip(files, digests):
        with np.errstate(over="ignore"):
            key = (int(_mix(d).sum(dtype=np.uint64)), int(f.request.size))
        if key in whole:
            raise InputError(f"{f.path} holds the same rounds as {whole[key]}: a copy of one trace",
                             "pass each trace once")
        whole[key] = f.path
    told = [(i, r[t], d[t]) for i, (r, d, t) in enumerate(digests)]
    digest = np.concatenate([d for _, _, d in told])
    owner = np.concatenate([np.full(d.size, i) for i, _, d in told])
    number = np.concatenate([r for _, r, _ in told])
    order = np.lexsort((owner, digest))
    d, o = digest[order], owner[order]
    hit = np.flatnonzero((d[1:] == d[:-1]) & (o[1:] != o[:-1]))
    if hit.size:
        # of the repeats, the one in the earliest file, its first copy in the file before it
        j = min(hit, key=lambda j: (o[j + 1], number[order[j + 1]]))
        a, b = order[j], order[j + 1]
        raise InputError(f"{files[owner[b]].path}: request {int(number[b])} repeats request {int(number[a])} of "
                         f"{files[owner[a]].path} round for round (the same request recorded twice, or copied)",
                         "pass each run once; a copy or a subset of a trace adds no data")


def _request_group(header: dict[str, Any], index: int) -> str:
    """What identifies a trace's requests across files (module doc)."""
    return "dataset " + _canon(header["dataset"]) if "dataset" in header else f"file {index}"


def _table(files: Sequence[TraceColumns], gamma: int | None) -> RoundTable:
    """The drafted rounds of `files` as one table; request keys dense, in order of first appearance."""
    keep = [f.drafted for f in files]
    cat = (lambda cols: np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64))
    source = cat([np.full(int(k.sum()), i, dtype=np.int64) for i, k in enumerate(keep)])
    request = cat([f.request[k] for f, k in zip(files, keep)])
    groups = {g: n for n, g in enumerate(dict.fromkeys(_request_group(f.header, i) for i, f in enumerate(files)))}
    group = np.array([groups[_request_group(f.header, i)] for i, f in enumerate(files)], dtype=np.int64)[source]
    _, code = np.unique(request, return_inverse=True)
    _, first, dense = np.unique(group * (code.max(initial=0) + 1) + code, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first)] = np.arange(first.size)
    g = gamma or 0
    logits = cat([f.logits.reshape(k.size, g)[k] for f, k in zip(files, keep)]).astype(np.float64)
    long = (lambda name: torch.from_numpy(cat([getattr(f, name)[k] for f, k in zip(files, keep)]).astype(np.int64)))
    return RoundTable(torch.from_numpy(logits.reshape(request.size, g)), long("verify_length"), long("accepted"),
                      torch.from_numpy(rank[dense.reshape(-1)]),
                      torch.from_numpy(cat([f.budget_capped[k] for f, k in zip(files, keep)]).astype(bool)),
                      gamma, source, request, cat([f.round[k] for f, k in zip(files, keep)]),
                      [f.path for f in files], [f.header for f in files], sum(int((~k).sum()) for k in keep),
                      [_counts(f) for f in files])


def _counts(f: TraceColumns) -> RoundCounts:
    """`RoundCounts` of one file, from its columns."""
    d, ell, bs = f.drafted.astype(bool), f.verify_length, f.block_size
    return RoundCounts(rounds=int(d.size), drafted=int(d.sum()), verified=int((d & (ell > 0)).sum()),
                       full=int((d & (ell == bs)).sum()),
                       capped=int((d & f.budget_capped.astype(bool) & (ell < bs)).sum()))


def _canon(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


def _short(v: Any) -> str:
    """A header value for a one-line message: repr, cut to 60 characters."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
