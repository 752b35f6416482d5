"""Live acceptance: real speculative rollouts with `static:γ` (every draft verified).

Empirical conditional acceptance, survival, τ and histogram come from `AcceptanceStats`;
the outputs double as target continuations for teacher-forced evaluation (speculative decoding
is lossless, so they are distributed exactly as the target's own samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dsparkctl.distributed import DATA_PARALLEL, Split
from dsparkctl.engine.decode import plain_decoder, run_prompts, speculative_decoder
from dsparkctl.engine.rounds import Streams
from dsparkctl.engine.speculative import SpeculativeEngine
from dsparkctl.formats.trace import TraceRound
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.stats import AcceptanceStats
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.target import TargetAdapter


@dataclass
class LiveResult:
    stats: AcceptanceStats  # the draft's own chain (engine/rounds.py)
    continuations: list[list[int]]  # generated ids per prompt (EOS included when hit)
    seconds: float  # wall time of the rollouts (prefill included)
    streams: Streams | None = None  # every proposer's outcomes (with context lookup: the copies' apart)
    per_prompt: list[AcceptanceStats] | None = None  # the draft's stream of each prompt (intervals over prompts)

    @property
    def positions(self) -> int:
        """Evaluated positions: drafts whose accept/reject outcome was observed."""
        return int(sum(self.stats.reached))


def live_rollouts(model: torch.nn.Module, draft: DSparkDraft, prompts: Sequence[Sequence[int]],
                  params: SamplingParams, max_new_tokens: int, stop_ids: Sequence[int], seed: int = 0,
                  batch_size: int = 8, on_round: Callable[[list[TraceRound]], None] | None = None,
                  on_batch: Callable[[int, int], None] | None = None, split: Split = DATA_PARALLEL,
                  lookup: bool = False) -> LiveResult:
    adapter = TargetAdapter(model, layer_ids=draft.cfg.target_layer_ids)
    engine = SpeculativeEngine(adapter, draft, parse_policy(f"static:{draft.block_size}"), params, stop_ids,
                               lookup=lookup)
    res = run_prompts(speculative_decoder(engine, max_new_tokens), prompts, batch_size, seed, adapter.device,
                      block_size=draft.block_size, on_round=on_round, on_batch=on_batch, split=split)
    return LiveResult(stats=res.stats, continuations=[o.tokens for o in res.outputs], seconds=res.wall_s,
                      streams=res.streams, per_prompt=[o.draft for o in res.outputs if o.draft is not None])


def target_continuations(model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
                         max_new_tokens: int, stop_ids: Sequence[int], seed: int = 0,
                         batch_size: int = 8, split: Split = DATA_PARALLEL) -> list[list[int]]:
    """Plain target decoding (for teacher-forced evaluation without a live run)."""
    adapter = TargetAdapter(model)
    res = run_prompts(plain_decoder(adapter, max_new_tokens, params, stop_ids), prompts, batch_size, seed,
                      adapter.device, split=split)
    return [o.tokens for o in res.outputs]
