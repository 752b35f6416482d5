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

`fit_table` turns the probes into a table: the lower quartile of each point's repeats (`SPSPoint.typical_ms`), fitted monotone
(`math.sps.fit_step_grid`; the plain step also held at or below the drafted step that verifies
nothing, which does the same forward plus the draft), the raw probes kept beside the fit, and a warning for each probe the
fit contradicts by more than its own spread (the repeats' range, at least 2%).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from dsparkctl.engine.clock import Clock, sync
from dsparkctl.engine.speculative import SpeculativeEngine
from dsparkctl.errors import UsageError, option
from dsparkctl.math.policies import Static
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.sps import SPSTable, StepGrid, fit_step_grid, isotonic
from dsparkctl.models.target import TargetAdapter
from dsparkctl.models.target_checks import position_limit
from dsparkctl.provenance import provenance


def lower_quartile(ms: Sequence[float]) -> float:
    """The statistic a step-cost fit reads (`SPSPoint.typical_ms`): the lower quartile of the repeats."""
    return ms[0] if len(ms) < 2 else statistics.quantiles(ms, n=4, method="inclusive")[0]


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

    @property
    def typical_ms(self) -> float:
        """What the fit reads: the lower quartile of the repeats. On a shared machine interference
        only ever adds time to a probe, so the low quartile estimates the step's own cost; on a
        2-core VM it kept 1..6-token steps in order where the median of 15 repeats did not."""
        return lower_quartile(self.ms)


def check_context(model: torch.nn.Module, context_len: int, tokens_per_request: Sequence[int],
                  settle: int = 0) -> None:
    """Refuse a grid that runs past the model's positions: context + `settle` tokens committed before
    the timed steps + the longest step must fit."""
    limit = position_limit(model)
    step = max(tokens_per_request) + settle
    need = context_len + step
    if limit is not None and need > limit:
        first = f" + {settle} committed first" if settle else ""
        raise UsageError(f"{option('context_len')} {context_len} + {max(tokens_per_request)} tokens per request{first}"
                         f" = {need} "
                         f"positions, beyond the model's {limit} (max_position_embeddings)",
                         f"use {option('context_len')} ≤ {limit - step}")


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


SETTLE_TOKENS = 2  # committed by the drafted round a whole-step profile runs before its timed ones


@torch.no_grad()
def profile_whole_step(engine: Any, requests: Sequence[int], tokens_per_request: Sequence[int], context_len: int,
                       repeats: int = 5, warmup: int = 2, seed: int = 0,
                       on_point: Callable[[SPSPoint], None] | None = None,
                       on_sweep: Callable[[int, int], None] | None = None) -> list[SPSPoint]:
    """Time the engine's own round (plan → draft → schedule → verify → commit, `SpeculativeEngine.round`)
    per grid point, verifying tokens_per_request - 1 drafts per request, and its plain step (no
    draft) per request count; each timed round is rewound (`SpeculativeEngine.mark`) so every
    repeat starts from the same context, one drafted round after the prefill (so a timed proposal
    takes in the tokens its predecessor committed, as in decoding). `on_sweep(done, total)` after
    each pass over one request count's probes (warm-up passes included)."""
    gamma = engine.draft.block_size
    check_verify_width(gamma, tokens_per_request)
    check_context(engine.target.model, context_len, tokens_per_request, settle=SETTLE_TOKENS)
    gen = torch.Generator().manual_seed(seed)
    dev = engine.target.device
    budget = gamma + 4  # after the settling round (≤ 2 tokens) ℓ ≤ γ is never capped by the token budget
    probes = {t: DraftEvery(t - 1) for t in set(tokens_per_request)}
    plain = parse_policy("static:0")  # no draft: the plain step
    points: list[SPSPoint] = []
    policy = engine.policy
    try:
        for R in sorted(set(requests)):
            prompts = torch.randint(0, engine.target.vocab_size, (R, context_len), generator=gen).tolist()
            live = engine.prefill(prompts, budget, None)
            engine.policy = DraftEvery(1)  # settle: a drafted round's committed tokens wait for the next
            engine.round(live, budget, None, Clock(dev))  # proposal, which takes them in (as when decoding)
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
    """One steps/s value per distinct batch-token count: the lower quartile of every repeat of every
    drafted (requests, tokens) combination that gives that count (raw, unfitted; `SPSPoint.typical_ms`)."""
    by_b: dict[int, list[float]] = {}
    for p in points:
        if not p.plain:
            by_b.setdefault(p.batch_tokens, []).extend(p.ms)
    bt = sorted(by_b)
    return bt, [1000.0 / lower_quartile(by_b[b]) for b in bt]


def fit_table(points: Sequence[SPSPoint], meta: dict[str, Any]) -> tuple[Any, list[str]]:
    """The SPS table of a profile: (SPSTable with a fitted `StepGrid`, warnings).

    The grid is every drafted point's lower quartile (`SPSPoint.typical_ms`), fitted monotone in requests and tokens; the plain
    step per request count likewise (when measured). The 1-D table SGLang reads is the fitted
    grid seen by batch tokens (median over the (R, t) with R·t = B, then fitted monotone in B).
    A warning names every probe whose lower quartile lies further from the fit than its spread."""

    drafted = [p for p in points if not p.plain]
    reqs = sorted({p.requests for p in drafted})
    toks = sorted({p.tokens_per_request for p in drafted})
    at = {(p.requests, p.tokens_per_request): p for p in drafted}
    missing = [(r, t) for r in reqs for t in toks if (r, t) not in at]
    if missing:
        raise UsageError(f"the profile misses grid points {missing[:4]}", "profile the whole requests × tokens grid")
    raw = [[at[(r, t)].typical_ms for t in toks] for r in reqs]
    fit = fit_step_grid(raw, [[len(at[(r, t)].ms) for t in toks] for r in reqs])
    plain_pts = {p.requests: p for p in points if p.plain}
    plain = isotonic([plain_pts[r].typical_ms for r in reqs]) if all(r in plain_pts for r in reqs) else None
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
    meta = {**meta, "fit": "isotonic step time (non-decreasing in requests and tokens per request) of each "
                          "probe's lower quartile; raw probes in points", "grid": grid.to_json(), "warnings": warnings}
    return SPSTable(bt, [1000.0 / m for m in ms], meta=meta, grid=grid), warnings


def _contradiction(p: SPSPoint, fitted: float, where: str) -> list[str]:
    noise = max(max(p.ms) - min(p.ms), 0.02 * p.typical_ms)
    if abs(p.typical_ms - fitted) <= noise:
        return []
    return [f"{where}: raw lower quartile {p.typical_ms:.2f} ms, fit {fitted:.2f} ms, beyond the repeats' spread "
            f"({max(p.ms) - min(p.ms):.2f} ms); a noisy machine or a kernel switch"]


def profile_table(sess: Any, measure: str, requests: Sequence[int], tokens_per_request: Sequence[int],
                  context_len: int, repeats: int, warmup: int, seed: int = 0,
                  on_point: Callable[[SPSPoint], None] | None = None,
                  on_sweep: Callable[[int, int], None] | None = None, **meta: Any) -> tuple[Any, list[str]]:
    """Profile the session (whole-step: its engine's round and plain step, `profile_whole_step`;
    target-forward: the target alone, `profile_sps`) and fit its table (`fit_table`): (SPSTable,
    warnings). The table records how it was measured, every raw probe, and `meta`."""

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
                 "q25_ms": round(p.typical_ms, 4),
                 "ms": [round(x, 4) for x in p.ms]} for p in points]))
