"""Live acceptance: real speculative rollouts with `static:γ` (every draft verified).

Empirical conditional acceptance, survival, τ and histogram come from `AcceptanceStats`;
the outputs double as target continuations for teacher-forced evaluation (speculative decoding
is lossless, so they are distributed exactly as the target's own samples).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.math.policies import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.stats import AcceptanceStats
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.target import TargetAdapter
from dsparkctl.trace import TraceRound


@dataclass
class LiveResult:
    stats: AcceptanceStats
    continuations: list[list[int]]  # generated ids per prompt (EOS included when hit)
    seconds: float  # wall time of the rollouts (prefill included)

    @property
    def positions(self) -> int:
        """Evaluated positions: drafts whose accept/reject outcome was observed."""
        return int(sum(self.stats.reached))


def live_rollouts(model: torch.nn.Module, draft: DSparkDraft, prompts: Sequence[Sequence[int]],
                  params: SamplingParams, max_new_tokens: int, stop_ids: Sequence[int], seed: int = 0,
                  batch_size: int = 8, on_round: Callable[[list[TraceRound]], None] | None = None,
                  on_batch: Callable[[int, int], None] | None = None) -> LiveResult:
    adapter = TargetAdapter(model, layer_ids=draft.cfg.target_layer_ids)
    engine = SpeculativeEngine(adapter, draft, parse_policy(f"static:{draft.block_size}"), params, stop_ids)
    gen = torch.Generator(device=adapter.device).manual_seed(seed)
    stats = AcceptanceStats(block_size=draft.block_size)
    conts: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        part = prompts[i: i + batch_size]

        def shifted(rows: list[TraceRound], base: int = i) -> None:  # request ids across batches
            if on_round:
                on_round([TraceRound(**{**r.__dict__, "request": r.request + base}) for r in rows])
        rep = engine.generate(part, max_new_tokens, gen, on_round=shifted if on_round else None)
        stats = stats.merge(rep.stats)
        conts.extend(o.tokens for o in rep.outputs)
        if on_batch:
            on_batch(min(i + batch_size, len(prompts)), len(prompts))
    return LiveResult(stats=stats, continuations=conts, seconds=time.perf_counter() - t0)


def target_continuations(model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
                         max_new_tokens: int, stop_ids: Sequence[int], seed: int = 0,
                         batch_size: int = 8) -> list[list[int]]:
    """Plain target decoding (for teacher-forced evaluation without a live run)."""
    adapter = TargetAdapter(model)
    gen = torch.Generator(device=adapter.device).manual_seed(seed)
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        rep = plain_generate(adapter, prompts[i: i + batch_size], max_new_tokens, params, stop_ids, gen)
        out.extend(o.tokens for o in rep.outputs)
    return out
