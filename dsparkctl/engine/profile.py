"""Steps-per-second profiling: the SPS table the schedulers plan with.

Two things can be timed (`MEASURES`), and every table records which:
  whole-step      one whole speculative step of our engine at B batch tokens: the draft's
                  proposal (backbone, Markov loop, confidence head), the verify-length schedule,
                  the target's forward over t tokens per request, the acceptance rule and the
                  draft's context update. This is what SGLang's table holds (its profiler times
                  the whole server step on a live DSpark server), and the default.
  target-forward  the target's verify forward alone (an upper bound on steps/s).

Batch tokens B = requests × tokens per request (SGLang's definition; t = 1 + drafts verified).
For each request count the batch is prefilled once to the chosen context length; each timed
step is rolled back exactly (the target's cache by commit 0, the draft's context by its length),
so every repeat sees the same state: acceptance is held fixed at "bonus only", as SGLang's
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
from typing import Any, Callable, Sequence

import torch

from dsparkctl.engine.clock import sync
from dsparkctl.errors import UsageError
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
        raise UsageError(f"--context-len {context_len} + {max(tokens_per_request)} tokens per request = {need} "
                         f"positions, beyond the model's {limit} (max_position_embeddings)",
                         f"use --context-len ≤ {limit - max(tokens_per_request)}")


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


@torch.no_grad()
def profile_whole_step(engine: Any, requests: Sequence[int], tokens_per_request: Sequence[int], context_len: int,
                       repeats: int = 5, warmup: int = 2, seed: int = 0,
                       on_point: Callable[[SPSPoint], None] | None = None) -> list[SPSPoint]:
    """Time draft + schedule + verify + context update (a SpeculativeEngine's round) per grid
    point, and the plain step (no draft) per request count."""
    gamma = engine.draft.block_size
    if max(tokens_per_request) > gamma + 1:
        raise UsageError(f"--tokens-per-request {max(tokens_per_request)} verifies more than the draft's "
                         f"γ={gamma} drafts + 1", f"use tokens per request ≤ {gamma + 1}")
    check_context(engine.target.model, context_len, tokens_per_request)
    gen = torch.Generator().manual_seed(seed)
    tgt, drf = engine.target, engine.draft
    dev = tgt.device
    V = tgt.vocab_size
    points: list[SPSPoint] = []
    for R in sorted(set(requests)):
        prompts = torch.randint(0, V, (R, context_len), generator=gen).tolist()
        live = engine.prefill(prompts, gamma + 2, None)
        ctx_len = live.context.ctx_len.clone()
        zero = torch.zeros(R, dtype=torch.long, device=dev)
        here = [SPSPoint(R, t, []) for t in sorted(set(tokens_per_request))] + [SPSPoint(R, 1, [], plain=True)]
        for i in range(warmup + repeats):
            for p in here:
                sync(dev)
                t0 = time.perf_counter()
                if p.plain:
                    engine.plain_step(live, None)
                else:
                    prop = drf.propose(live.context, live.anchors, engine.draft_sampling, None)
                    engine.policy.choose(prop.confidence_logits, block_size=gamma, num_requests=R)
                    ell = torch.full((R,), p.tokens_per_request - 1, dtype=torch.long, device=dev)
                    res, out = engine.verify(live, prop.block, ell, None)
                    drf.append_context(live.context, out.features, res.accepted + 1)
                sync(dev)
                dt = (time.perf_counter() - t0) * 1000.0
                tgt.commit(zero)  # exact rollback of the target ...
                live.context.ctx_len = ctx_len.clone()  # ... and of the draft's context
                if i >= warmup:
                    p.ms.append(dt)
        for p in here:
            points.append(p)
            if on_point:
                on_point(p)
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
