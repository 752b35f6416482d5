"""What one speculative round did for each live row, the records built from it (the trace rows
`calibrate` and `sweep-scheduler` read, each proposer's tally), and a run's report.

Three proposers fill a round's block, and their outcomes are kept apart (`Streams`):
  the draft    its chain x1..xℓ, verified; what verification did with it is the draft's
               per-position acceptance (c_j, a_j), whatever else the round verified beside it
  a sibling    greedy: a runner-up of x1 verified beside the chain; when the chain lost x1 and a
               sibling is the target's token, the round emits it (its own tally: rows, siblings
               verified, rows whose chain lost x1, rows that took one)
  the lookup   greedy: a block copied from where the context repeats itself, verified in place of
               the draft's (its own per-position acceptance)
The engine's τ is all of them together: tokens per speculative round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dsparkctl.formats.trace import TraceRound
from dsparkctl.math.stats import AcceptanceStats


@dataclass
class RequestOutput:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (EOS included when hit)
    finish_reason: str = "length"  # "stop" | "length"
    rounds: int = 0
    draft: AcceptanceStats | None = None  # this request's draft stream (intervals over prompts: math/stats.py)


@dataclass
class Round:
    """What one round did for each live row."""

    verify_lengths: torch.Tensor  # [n] ℓ of the block verified (the draft's chain, or the lookup's copy), budget capped
    budget_capped: torch.Tensor  # [n] bool, ℓ was cut below the policy's choice by the token budget
    accepted: torch.Tensor  # [n] drafts of that block accepted (a taken sibling is not one of them)
    emitted: torch.Tensor  # [n, γ+1] accepted drafts (or the sibling taken) then one recovered/bonus token (-1 padded)
    kept: torch.Tensor  # [n] emitted tokens kept (up to and including a stop token)
    stopped: torch.Tensor  # [n] bool, a stop token was emitted
    confidence_logits: torch.Tensor | None  # [n, γ]
    draft_ms: float
    verify_ms: float
    drafted: bool = True  # False: the policy skipped the draft (a plain step, ℓ = 0 for every row)
    siblings: int = 0  # siblings of x1 verified per row (engine/siblings.py)
    sibling_taken: torch.Tensor | None = None  # [n] the sibling each row accepted, -1 none
    looked_up: torch.Tensor | None = None  # [n] bool, the row verified a context-lookup block (engine/lookup.py)

    def took_sibling(self) -> torch.Tensor:
        """[n] bool: the row emitted a sibling of x1 (the chain lost x1)."""
        if self.sibling_taken is None:
            return torch.zeros_like(self.accepted, dtype=torch.bool)
        return self.sibling_taken >= 0

    def copied(self) -> torch.Tensor:
        """[n] bool: the row verified the lookup's block, not the draft's."""
        if self.looked_up is None:
            return torch.zeros_like(self.accepted, dtype=torch.bool)
        return self.looked_up


@dataclass
class Streams:
    """Each proposer's outcomes, apart (module doc), and the engine's tokens over them all."""

    draft: AcceptanceStats  # the draft's chain on the rounds that verified it
    lookup: AcceptanceStats  # the lookup's copies on the rounds that verified one
    sibling_rows: int = 0  # rounds whose chain was verified beside siblings of x1
    siblings_verified: int = 0  # siblings verified, over those rounds
    sibling_chances: int = 0  # of those rounds, the ones whose chain lost x1 (a sibling could step in)
    sibling_taken: int = 0  # rounds that emitted a sibling
    plain_rows: int = 0  # rows of plain steps (the policy skipped the draft)

    @classmethod
    def empty(cls, block_size: int) -> "Streams":
        return cls(draft=AcceptanceStats(block_size=block_size), lookup=AcceptanceStats(block_size=block_size))

    def add(self, rd: Round, per_request: list[AcceptanceStats | None] | None = None) -> None:
        """One round's rows; `per_request` (one tally per live row, or None) gets each row's draft round."""
        if not rd.drafted:
            self.plain_rows += int(rd.accepted.numel())
            return
        copied = rd.copied()
        mine = ~copied
        self.draft.add_rounds(rd.verify_lengths[mine], rd.accepted[mine])
        if per_request is not None:
            for tally, own, ell, a in zip(per_request, mine.tolist(), rd.verify_lengths.tolist(), rd.accepted.tolist()):
                if own and tally is not None:
                    tally.add_round(ell, a)
        self.lookup.add_rounds(rd.verify_lengths[copied], rd.accepted[copied])
        if rd.siblings:
            fed = mine & (rd.verify_lengths >= 1)
            self.sibling_rows += int(fed.sum())
            self.siblings_verified += rd.siblings * int(fed.sum())
            self.sibling_chances += int((fed & (rd.accepted == 0)).sum())
            self.sibling_taken += int(rd.took_sibling().sum())

    def merge(self, other: "Streams") -> "Streams":
        return Streams(draft=self.draft.merge(other.draft), lookup=self.lookup.merge(other.lookup),
                       sibling_rows=self.sibling_rows + other.sibling_rows,
                       siblings_verified=self.siblings_verified + other.siblings_verified,
                       sibling_chances=self.sibling_chances + other.sibling_chances,
                       sibling_taken=self.sibling_taken + other.sibling_taken,
                       plain_rows=self.plain_rows + other.plain_rows)

    @property
    def speculative_rounds(self) -> int:
        return self.draft.rounds + self.lookup.rounds

    @property
    def speculative_tokens(self) -> int:
        """Tokens the speculative rounds emitted: each block's accepted drafts, a taken sibling, one token."""
        return self.draft.tokens + self.lookup.tokens + self.sibling_taken

    @property
    def engine_tau(self) -> float | None:
        """Tokens per speculative round, every proposer together (plain steps apart)."""
        return self.speculative_tokens / self.speculative_rounds if self.speculative_rounds else None

    def engine_json(self) -> dict[str, Any]:
        return {"tau": self.engine_tau, "speculative_rounds": self.speculative_rounds,
                "tokens": self.speculative_tokens, "plain_rows": self.plain_rows,
                "rounds_by_proposer": {"draft": self.draft.rounds, "lookup": self.lookup.rounds,
                                       "sibling_taken": self.sibling_taken}}

    def siblings_json(self) -> dict[str, Any]:
        return {"rows_verified_with": self.sibling_rows, "siblings_verified": self.siblings_verified,
                "chain_lost_x1": self.sibling_chances, "rows_that_took_one": self.sibling_taken,
                "taken_when_chain_lost_x1": self.sibling_taken / self.sibling_chances if self.sibling_chances else None}


@dataclass
class RunReport:
    outputs: list[RequestOutput]
    streams: Streams
    times_ms: dict[str, float]  # speculative: prefill, draft, schedule, verify, accept, total; plain: prefill, decode, total
    rounds: int  # batched rounds (engine steps)
    drafted_steps: int = 0  # speculative engine steps: drafted or copied (the rest were plain steps the policy chose)

    @property
    def stats(self) -> AcceptanceStats:
        """The draft's own acceptance (its chain, on the rounds that verified it)."""
        return self.streams.draft

    @property
    def generated(self) -> int:
        return sum(len(o.tokens) for o in self.outputs)


def trace_rows(rd: Round, requests: list[int], round_no: list[int], gamma: int) -> list[TraceRound]:
    """One trace record per live row of a round (only built when a trace is being written). A row
    that verified the lookup's copy says so (`proposer`), without the draft's confidences; one
    that emitted a sibling keeps its chain's outcome and says it took one (`sibling_taken`)."""
    ell, acc, capped = rd.verify_lengths.tolist(), rd.accepted.tolist(), rd.budget_capped.tolist()
    conf = rd.confidence_logits.tolist() if rd.confidence_logits is not None else None
    copied, took = rd.copied().tolist(), rd.took_sibling().tolist()
    if conf is not None:  # a lookup block's outcome says nothing of the draft's head
        conf = [None if lk else c for c, lk in zip(conf, copied)]
    batch_tokens = int((rd.verify_lengths + 1).sum())
    return [TraceRound(request=req, round=round_no[req], block_size=gamma,
                       confidence_logits=conf[i] if conf is not None else None, verify_length=ell[i],
                       accepted=acc[i], batch_tokens=batch_tokens, draft_ms=round(rd.draft_ms, 3),
                       verify_ms=round(rd.verify_ms, 3), budget_capped=capped[i], drafted=rd.drafted,
                       extra=({"proposer": "lookup"} if copied[i] else {}) | ({"sibling_taken": True} if took[i] else {}))
            for i, req in enumerate(requests)]
