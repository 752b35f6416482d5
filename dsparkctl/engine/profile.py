"""Steps-per-second profiling: the SPS table the schedulers plan with.

Two things can be timed (`MEASURES`), and every table records which:
  whole-step      one whole round of our engine (`SpeculativeEngine.round`, the code that
                  decodes) at B batch tokens: the draft's proposal (backbone, Markov loop,
                  confidence head), the verify-length schedule, the target's forward over t
                  tokens per request, the acceptance rule and the commit to both caches. This is
                  what SGLang's table holds (its profiler times the whole server step on a live
                  DSpark server), and the default.
  target-forward  the target's verify forward alone (an upper bound on steps/s).

Batch tokens B = requests × tokens per request (SGLang's definition; t = 1 + drafts verified).
For each request count the batch is prefilled once to the chosen context length; each timed
round is rewound exactly (`SpeculativeEngine.mark`: the target's cache, the draft's context and
the rows), so every repeat sees the same state: acceptance is held fixed at "bonus only", as SGLang's
profiler holds it with SGLANG_SIMULATE_ACC_LEN=1.0. Whole-step profiles also time the PLAIN step
(the target's forward over one token per request and its draw, no draft): what a step costs when
the policy skips the draft. Repeats go round the grid (every point once, then again), so drift on
a busy machine spreads over all points; warm-up rounds are discarded. The device is synchronised
before every clock read.

`fit_table` turns the probes into a table: the median of each point's repeats, fitted monotone
(`math.sps.fit_step_grid`; the plain step also held at or below the drafted step that verifies
nothing, which does the same forward plus the draft), the raw probes kept beside the fit, and a warning for each probe the
fit contradicts by more than its own spread (the repeats' range, at least 2%).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dsparkctl.engine.clock import Clock, sync
from dsparkctl.engine.session import ModelSettings
from dsparkctl.errors import UsageError, option
from dsparkctl.math.policies import Static, parse_policy
from dsparkctl.models.target import TargetAdapter


@dataclass
class SPSPoint:
    requests: int
    tokens_per_request: int
    ms: list[float]  # every timed repeat
    plain: bool = False  # a step without a draft (tokens_per_request is then 1)

    @property
    def batch_tokens(self) -> int:
        return self.requests * self.tokens_per_request

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms)


def position_limit(model: torch.nn.Module) -> int | None:
    """The most positions the model was built for (`max_position_embeddings` or its aliases), if it says."""
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def check_context(model: torch.nn.Module, context_len: int, tokens_per_request: Sequence[int]) -> None:
    """Refuse a grid that runs past the model's positions: context + the longest step must fit."""
    limit = position_limit(model)
    need = context_len + max(tokens_per_request)
    if limit is not None and need > limit:
        raise UsageError(f"{option('context_len')} {context_len} + {max(tokens_per_request)} tokens per request = {need} "
                         f"positions, beyond the model's {limit} (max_position_embeddings)",
                         f"use {option('context_len')} ≤ {limit - max(tokens_per_request)}")


def check_verify_width(block_size: int, tokens_per_request: Sequence[int]) -> None:
    """Refuse whole steps that verify more tokens per request than the draft proposes + 1."""
    if max(tokens_per_request) > block_size + 1:
        raise UsageError(f"{option('tokens_per_request')} {max(tokens_per_request)} verifies more than the draft's "
                         f"γ={block_size} drafts + 1", f"use tokens per request ≤ {block_size + 1}")


def check_grid(requests: Sequence[int], tokens: Sequence[int]) -> None:
    """Refuse a grid with one batch-token count: SGLang reads a one-probe table as uninitialised."""
    if len({r * t for r in requests for t in tokens}) < 2:
        raise UsageError(f"the grid {option('requests')} {','.join(map(str, requests))} × {option('tokens_per_request')} "
                         f"{','.join(map(str, tokens))} gives one batch-token count; SGLang treats a one-probe "
                         "table as uninitialised (it verifies every draft)",
                         f"profile at least two batch-token counts, e.g. {option('tokens_per_request')} 1,2,4,6")


def check_batch_tokens(requests: Sequence[int], tokens: Sequence[int], context_len: int,
                       limit: int = 1 << 22) -> None:
    """Refuse a profiling grid whose largest batch (requests × (context + tokens)) would not fit a
    sane allocation (`limit` token positions, 4M by default): one line before any model loads."""
    worst = max(requests) * (context_len + max(tokens))
    if worst > limit:
        raise UsageError(f"{option('requests')} {max(requests)} with {option('context_len')} {context_len} and {max(tokens)} "
                         f"tokens per request is {worst:,} token positions in one batch (at most {limit:,})",
                         "profile fewer requests or a shorter context")


@torch.no_grad()
def profile_sps(adapter: TargetAdapter, requests: Sequence[int], tokens_per_request: Sequence[int],
                context_len: int, repeats: int = 5, warmup: int = 2, seed: int = 0,
                on_point: Callable[[SPSPoint], None] | None = None) -> list[SPSPoint]:
    check_context(adapter.model, context_len, tokens_per_request)
    gen = torch.Generator().manual_seed(seed)
    dev = adapter.device
    V = adapter.vocab_size
    points: list[SPSPoint] = []
    for R in sorted(set(requests)):
        prompts = torch.randint(0, V, (R, context_len), generator=gen).tolist()
        adapter.prefill(prompts)
        for t in sorted(set(tokens_per_request)):
            ids = torch.randint(0, V, (R, t), generator=gen).to(dev)
            lengths = torch.full((R,), t, dtype=torch.long, device=dev)
            zero = torch.zeros_like(lengths)
            ms = []
            for i in range(warmup + repeats):
                sync(dev)
                t0 = time.perf_counter()
                adapter.extend(ids, lengths)
                sync(dev)
                dt = (time.perf_counter() - t0) * 1000.0
                adapter.commit(zero)  # exact rollback
                if i >= warmup:
                    ms.append(dt)
            p = SPSPoint(R, t, ms)
            points.append(p)
            if on_point:
                on_point(p)
    return points


MEASURES = ("whole-step", "target-forward")


class DraftEvery(Static):
    """static:K that drafts every step, K = 0 too (a drafted step verifying nothing): what the
    whole-step profile times at t = K + 1 tokens per request. Profiling only."""

    def __init__(self, k: int):
        super().__init__(f"static:{k} (drafted)", k)

    @property
    def can_skip(self) -> bool:
        return False

    def plan(self, num_requests: int, state: Any = None) -> bool:
        return True


@torch.no_grad()
def profile_whole_step(engine: Any, requests: Sequence[int], tokens_per_request: Sequence[int], context_len: int,
                       repeats: int = 5, warmup: int = 2, seed: int = 0,
                       on_point: Callable[[SPSPoint], None] | None = None,
                       on_sweep: Callable[[int, int], None] | None = None) -> list[SPSPoint]:
    """Time the engine's own round (plan → draft → schedule → verify → commit, `SpeculativeEngine.round`)
    per grid point, verifying tokens_per_request - 1 drafts per request, and its plain step (no
    draft) per request count; each timed round is rewound (`SpeculativeEngine.mark`) so every
    repeat starts from the same context. `on_sweep(done, total)` after each pass over one request
    count's probes (warm-up passes included)."""
    gamma = engine.draft.block_size
    check_verify_width(gamma, tokens_per_request)
    check_context(engine.target.model, context_len, tokens_per_request)
    gen = torch.Generator().manual_seed(seed)
    dev = engine.target.device
    budget = gamma + 2  # ℓ ≤ γ is never capped by the token budget
    probes = {t: DraftEvery(t - 1) for t in set(tokens_per_request)}
    plain = parse_policy("static:0")  # no draft: the plain step
    points: list[SPSPoint] = []
    policy = engine.policy
    try:
        for R in sorted(set(requests)):
            prompts = torch.randint(0, engine.target.vocab_size, (R, context_len), generator=gen).tolist()
            live = engine.prefill(prompts, budget, None)
            rewind = engine.mark(live)
            here = [SPSPoint(R, t, []) for t in sorted(set(tokens_per_request))] + [SPSPoint(R, 1, [], plain=True)]
            for i in range(warmup + repeats):
                for p in here:
                    engine.policy = plain if p.plain else probes[p.tokens_per_request]
                    clock = Clock(dev)
                    clock.start()
                    engine.round(live, budget, None, clock)
                    clock.lap("commit")  # the round's laps end at verify
                    dt = sum(clock.totals.values())
                    rewind()
                    if i >= warmup:
                        p.ms.append(dt)
                if on_sweep:
                    on_sweep(len(points) // len(here) * (warmup + repeats) + i + 1,
                             len(set(requests)) * (warmup + repeats))
            for p in here:
                points.append(p)
                if on_point:
                    on_point(p)
    finally:
        engine.policy = policy
    return points


def table_from_points(points: Sequence[SPSPoint]) -> tuple[list[int], list[float]]:
    """One steps/s value per distinct batch-token count: median over every repeat of every
    drafted (requests, tokens) combination that gives that count (raw, unfitted)."""
    by_b: dict[int, list[float]] = {}
    for p in points:
        if not p.plain:
            by_b.setdefault(p.batch_tokens, []).extend(p.ms)
    bt = sorted(by_b)
    return bt, [1000.0 / statistics.median(by_b[b]) for b in bt]


def fit_table(points: Sequence[SPSPoint], meta: dict[str, Any]) -> tuple[Any, list[str]]:
    """The SPS table of a profile: (SPSTable with a fitted `StepGrid`, warnings).

    The grid is every drafted point's median, fitted monotone in requests and tokens; the plain
    step per request count likewise (when measured). The 1-D table SGLang reads is the fitted
    grid seen by batch tokens (median over the (R, t) with R·t = B, then fitted monotone in B).
    A warning names every probe whose median lies further from the fit than its spread."""
    from dsparkctl.math.sps import SPSTable, StepGrid, fit_step_grid, isotonic

    drafted = [p for p in points if not p.plain]
    reqs = sorted({p.requests for p in drafted})
    toks = sorted({p.tokens_per_request for p in drafted})
    at = {(p.requests, p.tokens_per_request): p for p in drafted}
    missing = [(r, t) for r in reqs for t in toks if (r, t) not in at]
    if missing:
        raise UsageError(f"the profile misses grid points {missing[:4]}", "profile the whole requests × tokens grid")
    raw = [[at[(r, t)].median_ms for t in toks] for r in reqs]
    fit = fit_step_grid(raw, [[len(at[(r, t)].ms) for t in toks] for r in reqs])
    plain_pts = {p.requests: p for p in points if p.plain}
    plain = isotonic([plain_pts[r].median_ms for r in reqs]) if all(r in plain_pts for r in reqs) else None
    if plain is not None:  # a plain step is a drafted step's verify without the draft: never dearer
        plain = [min(v, row[0]) for v, row in zip(plain, fit)]
    grid = StepGrid(reqs, toks, fit, plain)
    warnings = []
    for i, r in enumerate(reqs):
        for j, t in enumerate(toks):
            warnings += _contradiction(at[(r, t)], fit[i][j], f"{r} request(s) × {t} token(s)")
        if plain is not None:
            warnings += _contradiction(plain_pts[r], plain[i], f"plain step at {r} request(s)")
    by_b: dict[int, list[float]] = {}
    for i, r in enumerate(reqs):
        for j, t in enumerate(toks):
            by_b.setdefault(r * t, []).append(fit[i][j])
    bt = sorted(by_b)
    ms = isotonic([statistics.median(by_b[b]) for b in bt])
    meta = {**meta, "fit": "isotonic step time (non-decreasing in requests and tokens per request); raw "
                          "probes in points", "grid": grid.to_json(), "warnings": warnings}
    return SPSTable(bt, [1000.0 / m for m in ms], meta=meta, grid=grid), warnings


def _contradiction(p: SPSPoint, fitted: float, where: str) -> list[str]:
    noise = max(max(p.ms) - min(p.ms), 0.02 * p.median_ms)
    if abs(p.median_ms - fitted) <= noise:
        return []
    return [f"{where}: raw median {p.median_ms:.2f} ms, fit {fitted:.2f} ms, beyond the repeats' spread "
            f"({max(p.ms) - min(p.ms):.2f} ms); a noisy machine or a kernel switch"]


def profile_table(sess: Any, measure: str, requests: Sequence[int], tokens_per_request: Sequence[int],
                  context_len: int, repeats: int, warmup: int, seed: int = 0,
                  on_point: Callable[[SPSPoint], None] | None = None,
                  on_sweep: Callable[[int, int], None] | None = None, **meta: Any) -> tuple[Any, list[str]]:
    """Profile the session (whole-step: its engine's round and plain step, `profile_whole_step`;
    target-forward: the target alone, `profile_sps`) and fit its table (`fit_table`): (SPSTable,
    warnings). The table records how it was measured, every raw probe, and `meta`."""
    from dsparkctl.engine.speculative import SpeculativeEngine
    from dsparkctl.math.sampling import SamplingParams
    from dsparkctl.provenance import provenance

    whole = measure == "whole-step"
    if whole:
        gamma = sess.draft.block_size
        engine = SpeculativeEngine(sess.adapter, sess.draft, parse_policy(f"static:{gamma}"), SamplingParams(0.0),
                                   stop_token_ids=sess.stop_ids)
        points = profile_whole_step(engine, requests, tokens_per_request, context_len, repeats, warmup, seed, on_point,
                                    on_sweep)
    else:
        points = profile_sps(sess.plain_adapter(), requests, tokens_per_request, context_len, repeats, warmup, seed,
                             on_point)
    return fit_table(points, provenance(
        target=sess.target.name, measures=measure, device=str(sess.device),
        dtype=str(sess.dtype).replace("torch.", ""), cpu_kernels=sess.cpu_kernels, context_len=context_len,
        repeats=repeats, warmup=warmup, block_size=sess.draft.block_size if whole else None,
        conditions=sess.conditions(), **meta,
        points=[{"requests": p.requests, "tokens_per_request": p.tokens_per_request, "plain": p.plain,
                 "batch_tokens": p.batch_tokens, "median_ms": round(p.median_ms, 4),
                 "ms": [round(x, 4) for x in p.ms]} for p in points]))


MAX_REPEATS = 1000  # per grid point; a typo such as 99999999999 would profile for years


@dataclass(frozen=True)
class ProfileSpec(ModelSettings):
    """Everything `profile-sps` runs, as the user gave it (`run_profile` checks it)."""
    out: Path = Path("sps.json")  # our table; the SGLang table and the PNG default beside it
    sglang_out: Path | None = None  # None: <out stem>.sglang.json
    plot: Path | None = None  # None: <out stem>.png
    measure: str = "whole-step"  # one of MEASURES
    requests: tuple[int, ...] = (1, 2, 4, 8)
    tokens_per_request: tuple[int, ...] | None = None  # None: 1..γ+1 (whole-step) or 1,2,3,4,6,8
    context_len: int = 256  # cached context tokens per request
    repeats: int = 5  # timed repeats per point (median)
    warmup: int = 2  # untimed warm-up steps per point
    draft: str | None = None  # whole-step only; None: the shipped draft


def run_profile(spec: ProfileSpec, *,
                log: Callable[[str], None] = lambda m: None,
                on_progress: Callable[[int, int], None] | None = None) -> tuple[dict[str, Any], Any]:
    """Check the spec (numbers, grid, every output path before any model loads; the grid against
    the model before kernel timing), profile, fit, write our table, SGLang's and the PNG: (the
    result document, the SPSTable). `on_progress(done, total)` counts grid points."""
    import itertools

    from dsparkctl.checks import Output, check_outputs, local_inputs
    from dsparkctl.engine.session import open_session, open_target
    from dsparkctl.fsutil import staged
    from dsparkctl.plots import plot_sps
    from dsparkctl.sps_io import save_sps_table

    whole = spec.measure == "whole-step"
    if spec.measure not in MEASURES:
        raise UsageError(f"unknown measure {spec.measure!r}", f"use one of {', '.join(MEASURES)}")
    if spec.target_parallel != "none":
        raise UsageError(f"profile-sps times one process on one device; {option('target_parallel')} "
                         f"{spec.target_parallel!r} is for generate and eval-acceptance",
                         "profile the target on one device (the table's costs are per device)")
    if spec.context_len < 1 or spec.repeats < 1 or spec.warmup < 0:
        raise UsageError(f"{option('context_len')} and {option('repeats')} must be >= 1, {option('warmup')} >= 0",
                         f"e.g. {option('context_len')} 256 {option('repeats')} 5 {option('warmup')} 2")
    if spec.repeats > MAX_REPEATS or spec.warmup > MAX_REPEATS:
        raise UsageError(f"{option('repeats')} and {option('warmup')} must be at most {MAX_REPEATS}, got "
                         f"{spec.repeats} and {spec.warmup}",
                         f"e.g. {option('repeats')} 5 {option('warmup')} 2 (medians settle within a few)")
    inputs = local_inputs(target=spec.target, drafts=[spec.draft])
    check_outputs([Output(spec.out, option("out"))], inputs)  # first: the other names derive from it
    sg = spec.sglang_out or spec.out.with_name(spec.out.stem + ".sglang.json")
    png = spec.plot or spec.out.with_suffix(".png")
    check_outputs([Output(spec.out, option("out")), Output(sg, option("sglang_out")), Output(png, option("plot"), "figure")], inputs)
    reqs = list(spec.requests)
    toks = list(spec.tokens_per_request) if spec.tokens_per_request is not None else (None if whole else [1, 2, 3, 4, 6, 8])
    if toks is not None:
        check_grid(reqs, toks)  # before any model loads
    check_batch_tokens(reqs, toks or [8], spec.context_len)
    if whole:
        sess = open_session(spec.target, spec.draft, spec.device, spec.dtype, spec.revision, spec.trust_remote_code,
                            spec.seed, log=log, cpu_kernels=spec.cpu_kernels, settle=False)
        gamma = sess.draft.block_size
        if toks is None:
            toks = list(range(1, gamma + 2))
            check_grid(reqs, toks)
        check_verify_width(gamma, toks)
    else:
        sess = open_target(spec.target, spec.device, spec.dtype, spec.revision, spec.trust_remote_code, log=log,
                           cpu_kernels=spec.cpu_kernels, settle=False)
    check_context(sess.target.model, spec.context_len, toks)
    sess.settle_kernels(log)  # every input is checked: the timing is not wasted
    done = itertools.count(1)
    n_points = len(set(reqs)) * (len(set(toks)) + whole)
    drafted = ((str(Path(spec.draft).resolve()) if spec.draft and Path(spec.draft).exists() else sess.draft_name)
               if whole else None)
    table, warnings = profile_table(sess, spec.measure, reqs, toks, spec.context_len, spec.repeats, spec.warmup,
                                    spec.seed, on_point=(lambda p: on_progress(next(done), n_points))
                                    if on_progress else None, draft=drafted)
    bt, sps = table.batch_tokens, table.steps_per_sec
    dev, dt = sess.device, str(sess.dtype).replace("torch.", "")
    with staged() as stage:  # the three appear together, or none (serve-config reads the SGLang twin beside ours)
        plot_sps(bt, sps, stage(png), f"{sess.target.name} on {dev} ({dt}), context {spec.context_len}, "
                 f"{spec.measure}", as_path=png)
        save_sps_table(table, stage(sg), fmt="sglang")
        save_sps_table(table, stage(spec.out), fmt="dsparkctl")
    doc = {"table": str(spec.out), "sglang_table": str(sg), "plot": str(png), "measures": spec.measure,
           "batch_tokens": bt, "steps_per_sec": [round(s, 3) for s in sps],
           "ms_per_step": [round(1000 / s, 3) for s in sps], "grid": table.grid.to_json(), "warnings": warnings}
    return doc, table
