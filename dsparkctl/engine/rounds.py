"""What one speculative round did for each live row, the records built from it (the trace rows
`calibrate` and `sweep-scheduler` read, the sibling counts of a run's report), and a run's report."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsparkctl.formats.trace import TraceRound
from dsparkctl.math.stats import AcceptanceStats


@dataclass
class RequestOutput:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (EOS included when hit)
    finish_reason: str = "length"  # "stop" | "length"
    rounds: int = 0


@dataclass
class RunReport:
    outputs: list[RequestOutput]
    stats: AcceptanceStats
    times_ms: dict[str, float]  # speculative: prefill, draft, schedule, verify, accept, total; plain: prefill, decode, total
    rounds: int  # batched rounds (engine steps)
    drafted_steps: int = 0  # speculative engine steps: drafted or copied (the rest were plain steps the policy chose)
    siblings: dict[str, int] = field(default_factory=dict)  # rows verified with siblings, rows that took one

    @property
    def generated(self) -> int:
        return sum(len(o.tokens) for o in self.outputs)


@dataclass
class Round:
    """What one round did for each live row."""

    verify_lengths: torch.Tensor  # [n] ℓ after the budget cap (1 where a sibling of x1 was taken: its round
                                  # verified one position, by the chain's x1 and its siblings together)
    budget_capped: torch.Tensor  # [n] bool, ℓ was cut below the policy's choice by the token budget
    accepted: torch.Tensor  # [n] drafts accepted
    emitted: torch.Tensor  # [n, γ+1] accepted drafts then one recovered/bonus token (-1 padded)
    kept: torch.Tensor  # [n] emitted tokens kept (up to and including a stop token)
    stopped: torch.Tensor  # [n] bool, a stop token was emitted
    confidence_logits: torch.Tensor | None  # [n, γ]
    draft_ms: float
    verify_ms: float
    drafted: bool = True  # False: the policy skipped the draft (a plain step, ℓ = 0 for every row)
    siblings: int = 0  # siblings of x1 verified per row (engine/siblings.py)
    sibling_taken: torch.Tensor | None = None  # [n] the sibling each row accepted, -1 none
    looked_up: torch.Tensor | None = None  # [n] bool, the row verified a context-lookup block (engine/lookup.py)


def count_siblings(sibs: dict[str, int], rd: Round) -> None:
    """Add a round's rows verified with siblings (ℓ ≥ 1 where siblings were fed) and rows that took
    one, and its rows that verified a context-lookup block (`lookup`)."""
    if rd.looked_up is not None:
        sibs["lookup"] = sibs.get("lookup", 0) + int(rd.looked_up.sum())
    if rd.siblings:
        sibs["rows"] = sibs.get("rows", 0) + int((rd.verify_lengths >= 1).sum())
        sibs["taken"] = sibs.get("taken", 0) + int((rd.sibling_taken >= 0).sum())


def trace_rows(rd: Round, requests: list[int], round_no: list[int], gamma: int) -> list[TraceRound]:
    """One trace record per live row of a round (only built when a trace is being written)."""
    ell, acc, capped = rd.verify_lengths.tolist(), rd.accepted.tolist(), rd.budget_capped.tolist()
    conf = rd.confidence_logits.tolist() if rd.confidence_logits is not None else None
    if conf is not None and rd.looked_up is not None:  # a lookup block's outcome says nothing of the draft's head
        conf = [None if lk else c for c, lk in zip(conf, rd.looked_up.tolist())]
    batch_tokens = int((rd.verify_lengths + 1).sum())
    return [TraceRound(request=req, round=round_no[req], block_size=gamma,
                       confidence_logits=conf[i] if conf is not None else None, verify_length=ell[i],
                       accepted=acc[i], batch_tokens=batch_tokens, draft_ms=round(rd.draft_ms, 3),
                       verify_ms=round(rd.verify_ms, 3), budget_capped=capped[i], drafted=rd.drafted)
            for i, req in enumerate(requests)]
