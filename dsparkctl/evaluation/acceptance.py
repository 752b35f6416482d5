"""Acceptance per prompt set and draft, teacher-forced and/or live: the eval-acceptance document.

`evaluate_acceptance` runs every (dataset, draft) pair, merges ranks under torchrun and adds the
agreement of the two measures; the per-pair live trace paths come from `trace_paths`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dsparkctl.distributed import DATA_PARALLEL, Split
from dsparkctl.errors import UsageError, option
from dsparkctl.evaluation.continuations import cached_continuations
from dsparkctl.evaluation.live import LiveResult, live_rollouts
from dsparkctl.evaluation.teacher_forced import evaluate_sequences
from dsparkctl.formats.calibration import load_temperatures, own_calibration
from dsparkctl.formats.trace import TraceWriter
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.stats import acceptance_intervals
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.provenance import provenance
from dsparkctl.tuning.calibration import confidence_report

FORMAT = "dsparkctl-eval-acceptance/1"
MODES = ("teacher-forced", "live", "both")


@dataclass
class DraftUnderTest:
    label: str  # display name, unique per run
    draft: DSparkDraft
    source: str  # where it was loaded from
    calibration: Path | None = None  # the draft's own calibration.json (confidence report with its temperatures)


@dataclass(frozen=True)
class EvalOptions:
    mode: str  # one of MODES
    params: SamplingParams
    max_new_tokens: int
    seed: int = 0
    batch_size: int = 8
    trace: Path | None = None  # live round traces (see `trace_path`); None: no traces
    preset: str | None = None  # recorded in the document
    lookup: bool = False  # greedy: the draft with context lookup (engine/lookup.py), its own figures beside


def drafts_under_test(sess: Any, sources: Sequence[str | None], labels: Sequence[str] | None = None,
                      revision: str | None = None, seed: int = 0) -> tuple[list[DraftUnderTest], list[str]]:
    """Load each draft (a folder, a hub id, or None for the session's default) against the session's target:
    (drafts, notes to tell the user). A draft's label is given, else its folder name or hub id."""

    drafts, notes = [], []
    for i, src in enumerate(sources):
        d, name, n = sess.load_draft(src, revision, seed)
        notes += n
        label = labels[i] if labels else ((Path(src).name or src) if src else name)
        cal = own_calibration(sess.draft_folder(src), d.fingerprint())
        if cal is not None:  # a damaged file fails here, in one line, not after the rollouts
            load_temperatures(cal, d.block_size)
        drafts.append(DraftUnderTest(label=label, draft=d, source=name, calibration=cal))
    seen = [d.label for d in drafts]
    twice = sorted({x for x in seen if seen.count(x) > 1})
    if twice:
        raise UsageError(f"two drafts would both be reported as {twice[0]!r}", f"name each with {option('labels')}")
    return drafts, notes


def trace_path(trace: Path | None, dataset: str, label: str, several: bool) -> Path | None:
    """Where the live rounds of one (dataset, draft) pair go: `trace` itself when the run has one
    pair, else `<stem>.<dataset stem>_<label><suffix>` beside it (suffix default .jsonl; characters
    other than letters, digits, '-' and '_' in the dataset stem and label become '_')."""
    if trace is None:
        return None
    if not several:
        return trace
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in f"{Path(dataset).stem}.{label}")
    return trace.with_name(f"{trace.stem}.{safe}{trace.suffix or '.jsonl'}")


def trace_paths(trace: Path | None, datasets: Sequence[str], labels: Sequence[str]) -> dict[tuple[str, str], Path]:
    """`trace_path` for every (dataset, label) pair, made unique: two pairs whose names fold to the
    same file (p.txt in two folders, labels a.b and a_b) get -2, -3, … rather than one overwriting
    the other."""
    if trace is None:
        return {}
    several = len(datasets) * len(labels) > 1
    out: dict[tuple[str, str], Path] = {}
    taken: set[Path] = set()
    for ds in datasets:
        for label in labels:
            p = base = trace_path(trace, ds, label, several)
            n = 1
            while p in taken:
                n += 1
                p = base.with_name(f"{base.stem}-{n}{base.suffix}")
            taken.add(p)
            out[(ds, label)] = p
    return out


def evaluate_acceptance(model: Any, target_name: str, drafts: Sequence[DraftUnderTest],
                        prompts: dict[str, Sequence[Sequence[int]]], opts: EvalOptions, stop_ids: Sequence[int],
                        log: Callable[[str], None] = lambda s: None, split: Split = DATA_PARALLEL) -> dict[str, Any]:
    """Every draft on every prompt set (dataset name -> prompt ids): the eval-acceptance document.
    `split`: how the work is shared among torchrun ranks (the session's `split`)."""
    if opts.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {opts.mode!r}")
    paths = trace_paths(opts.trace, list(prompts), [d.label for d in drafts])
    t = opts.params.temperature
    doc: dict[str, Any] = {"format": FORMAT, "mode": opts.mode, "temperature": t, "preset": opts.preset,
                           "max_new_tokens": opts.max_new_tokens, "seed": opts.seed, "target": target_name,
                           "lookup": opts.lookup and opts.params.greedy,
                           "datasets": {}, "provenance": provenance(command="eval-acceptance", seed=opts.seed)}
    for ds, ids in prompts.items():
        log(f"{ds}: {len(ids)} prompts, mode {opts.mode}, T={t}")
        doc["datasets"][ds] = evaluate_dataset(
            model, drafts, ids, mode=opts.mode, params=opts.params, max_new_tokens=opts.max_new_tokens,
            stop_ids=stop_ids, seed=opts.seed, batch_size=opts.batch_size,
            trace_path=lambda label, ds=ds: paths.get((ds, label)),
            trace_header={"target": target_name, "dataset": ds, "temperature": t, "seed": opts.seed},
            log=lambda s: log(f"  {s}"), split=split, lookup=opts.lookup)
    return doc


def live_json(res: LiveResult, lookup: bool = False) -> dict[str, Any]:
    """The draft's own live figures at the top; with context lookup, the copies' and the engine's
    τ over both under `lookup` (engine/rounds.py)."""
    s = res.stats
    out = {**s.to_json(), **acceptance_intervals(s, res.per_prompt or []), "positions": res.positions, "seconds": round(res.seconds, 3),
           "ms_per_position": round(1000 * res.seconds / max(res.positions, 1), 4)}
    if lookup and res.streams is not None:
        look = res.streams.lookup
        out["lookup"] = {"rounds_looked_up": look.rounds, "copies": look.to_json() if look.rounds else None,
                         "engine_tau": res.streams.engine_tau}
    return out


def evaluate_dataset(model: Any, drafts: Sequence[DraftUnderTest], prompts: Sequence[Sequence[int]], *, mode: str,
                     params: SamplingParams, max_new_tokens: int, stop_ids: Sequence[int], seed: int,
                     batch_size: int = 8, trace_path: Callable[[str], Path | None] = lambda label: None,
                     trace_header: dict[str, Any] | None = None,
                     log: Callable[[str], None] = lambda s: None, split: Split = DATA_PARALLEL,
                     lookup: bool = False) -> dict[str, Any]:
    """Results for one prompt set: {"prompts": n, "drafts": {label: {"live": ..., "teacher_forced": ...}}}."""
    out: dict[str, Any] = {"prompts": len(prompts), "drafts": {}}
    shared: list[list[int]] | None = None  # target continuations reused by every draft's TF pass
    for d in drafts:
        r: dict[str, Any] = {"source": d.source, "kind": d.draft.cfg.kind, "block_size": d.draft.block_size}
        conts = None
        if mode in ("live", "both"):
            tp = trace_path(d.label)  # under torchrun rank 0 writes the merged trace (TraceWriter)
            writer = TraceWriter(tp, {**(trace_header or {}), "draft": d.source, "draft_fingerprint": d.draft.fingerprint(),
                                      "block_size": d.draft.block_size,
                                      "policy": f"static:{d.draft.block_size}"}) if tp else None
            rounds: list = []  # kept for the confidence report: only a draft with a head has one
            keep = d.draft.confidence_head is not None

            def on_round(rows, writer=writer, rounds=rounds, keep=keep):
                if keep:
                    rounds.extend(rows)
                if writer:
                    writer.write(rows)

            with writer if writer else contextlib.nullcontext():  # rows are built only when someone listens
                live = live_rollouts(model, d.draft, prompts, params, max_new_tokens, stop_ids, seed, batch_size,
                                     on_round=on_round if keep or writer else None, split=split, lookup=lookup)
            if writer:
                r["trace"] = str(tp)
            r["live"] = live_json(live, lookup and params.greedy)
            r["live"]["confidence"] = confidence_report(rounds, d.calibration)  # rank 0 gets every rank's rounds
            conts = live.continuations
            log(f"{d.label}: live τ {live.stats.tau:.3f} in {live.seconds:.1f}s")
        if mode in ("teacher-forced", "both"):
            if conts is None:
                if shared is None:
                    t = time.perf_counter()
                    shared, cached = cached_continuations(model, prompts, params, max_new_tokens, stop_ids, seed,
                                                          batch_size, log=log, split=split)  # computed once
                    out["continuation_seconds"] = round(time.perf_counter() - t, 3)
                    out["continuations_from_cache"] = cached
                conts = shared
            seqs = [list(p) + list(c) for p, c in zip(prompts, conts)]
            t = time.perf_counter()
            with torch.no_grad():
                tf = evaluate_sequences(d.draft, model, seqs, [len(p) for p in prompts], params, min(batch_size, 8),
                                        split=split, lookup=lookup)
            secs = time.perf_counter() - t
            r["teacher_forced"] = {**tf.to_json(), "positions": tf.positions, "seconds": round(secs, 3),
                                   "ms_per_position": round(1000 * secs / max(tf.positions, 1), 4),
                                   "continuations": "live outputs" if "live" in r else "target decoding"}
            log(_tf_line(d.label, tf, secs))
        if "live" in r and "teacher_forced" in r:
            r["agreement"] = agreement(r["live"], r["teacher_forced"])
            r["speed_ratio_live_over_tf"] = (r["live"]["ms_per_position"] / r["teacher_forced"]["ms_per_position"]
                                             if r["teacher_forced"]["ms_per_position"] > 0 else None)
        out["drafts"][d.label] = r
    return out


def _tf_line(label: str, tf: Any, secs: float) -> str:
    """The log line of a teacher-forced pass (with context lookup: the draft's own τ beside)."""
    pair = tf.with_lookup
    alone = f" (with context lookup: {pair.tau:.3f})" if pair is not None and pair.tau else ""
    return f"{label}: teacher-forced τ {tf.tau if tf.tau is not None else float('nan'):.3f}{alone} in {secs:.1f}s"


def agreement(live: dict[str, Any], tf: dict[str, Any]) -> dict[str, Any]:
    """Per position: do the live and teacher-forced conditional acceptance agree at 95%?

    `within` = one point estimate lies inside the other's 95% interval; `overlap` = the two
    intervals intersect (the weaker check, reported for completeness).
    """
    rows = []
    for j, (lc, tc, li, ti) in enumerate(zip(live["conditional"], tf["conditional"], live["conditional_interval"],
                                             tf["conditional_interval"])):
        if lc is None or tc is None or li is None or ti is None:
            rows.append({"position": j + 1, "within": None, "overlap": None})
            continue
        within = bool(li[0] <= tc <= li[1] or ti[0] <= lc <= ti[1])
        overlap = bool(li[0] <= ti[1] and ti[0] <= li[1])
        rows.append({"position": j + 1, "live": float(lc), "teacher_forced": float(tc), "within": within,
                     "overlap": overlap})
    return {"positions": rows, "all_overlap": all(r["overlap"] is not False for r in rows),
            "all_within": all(r["within"] is not False for r in rows)}
