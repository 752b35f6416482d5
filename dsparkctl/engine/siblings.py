"""Sibling drafts: the draft's runners-up for the first position, verified beside its chain.

A round verifies the chain [x0, x1..xℓ]; when the target rejects x1 the round emits one token.
Where a verify forward's extra tokens cost little (one request on a CPU: a 6-token forward costs
about what a 3-token one does), the round can also verify the draft's next-best candidates for
position 1, x1′, x1″, …, as siblings of x1: each attends to the context and x0 only, at x1's
position, so the target's forward scores all of them at once (a tree whose root has the chain
and N leaves). Greedy verification then accepts a sibling exactly when the target's own token
after x0 is that sibling: the round emits it and the target's token after it (two tokens instead
of one). Nothing but the target's argmax is ever emitted, so output stays identical to plain
greedy decoding; siblings are for greedy verification only (a sampled tree needs a multi-draft
acceptance rule, which this is not).

How many (`plan`, for `auto`): the chain length L (at most what the policy chose) and sibling
count N that maximise expected tokens per second of the step, the SPS table pricing a step of
1 + L + N tokens per request, and never wider than the table measured (a tree wider than its
probes would be priced by extrapolation, which on this CPU undercharges: a 7-token forward costs
markedly more than the 6-token probe's slope says). The chain's tokens come from the calibrated
survivals, as the policy's own; a sibling brings one token with the probability the draft gives it
at position 1, times what the runners-up have realised of their probabilities so far in this
batch (`SiblingRate`: taken / promised, starting from the draft's own word, a prior worth two
tokens: starting lower would choose no siblings, and so never learn). The draft's own
probabilities are generous: on MT-Bench the shipped draft's runners-up have mean probability 0.134,
0.060, 0.035 against 0.101, 0.052, 0.029 taken teacher-forced, and live, where its context is its
own target's text, fewer still. Decided before the target sees this round's drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsparkctl.errors import UsageError, option
from dsparkctl.math.sps import SPSTable
from dsparkctl.math.verify import VerifyResult

AUTO = "auto"
MAX_SIBLINGS = 4  # what `auto` may choose, and what the draft proposes for it
PRIOR_PROMISED, PRIOR_SCALE = 2.0, 1.0  # SiblingRate's prior: the draft's own word, worth 2 tokens promised
RESOLUTION = 0.02  # what a step-cost table resolves at one request (its probes' quartiles differ by ~1 ms in 38)


def parse_siblings(value: str | int | None, greedy: bool = True) -> int | str:
    """`--siblings`: "auto" (priced by the SPS table; none without one, and none when sampling) or
    a fixed count 0..16, which needs greedy decoding (`greedy`)."""
    how = f"use {option('siblings')} auto, or a count such as 0 or 2"
    if value is None or str(value).strip().lower() == AUTO:
        return AUTO
    try:
        n = int(str(value).strip())
    except ValueError:
        raise UsageError(f"{option('siblings')} {str(value)!r} is neither auto nor a whole number", how) from None
    if not 0 <= n <= 16:
        raise UsageError(f"{option('siblings')} {n} is outside 0..16", how)
    if n and not greedy:
        raise UsageError(f"{option('siblings')} {n} verifies a tree, which only greedy decoding can",
                         f"use {option('siblings')} 0 (or auto) with {option('temperature')} above 0")
    return n


@dataclass
class SiblingFeed:
    """One round's tree: the chain's Tc columns (x0..x_{Tc-1}, row r's first ℓ_r + 1 valid), then
    N sibling columns (valid where `valid[r, j]`). `tokens` [R, N] target ids."""

    tokens: Tensor
    valid: Tensor
    chain: int  # Tc = 1 + max ℓ


def sibling_feed(alternatives: Tensor, ell: Tensor, count: int) -> SiblingFeed | None:
    """The first `count` alternatives of rows that verify at least one draft; None when none do."""
    if count <= 0 or alternatives is None or alternatives.shape[1] == 0:
        return None
    count = min(count, int(alternatives.shape[1]))
    valid = (ell >= 1)[:, None].expand(-1, count).clone()
    if not bool(valid.any()):
        return None
    return SiblingFeed(tokens=alternatives[:, :count], valid=valid, chain=int(ell.max()) + 1)


def tree_layout(feed: SiblingFeed, chain_valid: Tensor, cached: Tensor, seq_len: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(mask [R, 1, T, S+T] bool, positions [R, T], new slots' validity [R, T]) for a tree feed.
    chain_valid [R, Tc]: the chain's columns that hold a token; cached [R, S]: valid cached slots.
    The chain attends causally, as in a plain verify; a sibling attends to the cache, x0 and itself."""
    R, Tc = chain_valid.shape
    N = feed.tokens.shape[1]
    T = Tc + N
    dev = chain_valid.device
    new_valid = torch.cat([chain_valid, feed.valid], dim=1)  # [R, T]
    ar = torch.arange(T, device=dev)
    sees = ar[None, :] <= ar[:, None]  # [T, T] causal
    sees[Tc:, 1:] = False  # a sibling sees x0 ...
    sees[Tc:, Tc:] = torch.eye(N, dtype=torch.bool, device=dev)  # ... and itself
    new = sees[None] & new_valid[:, None, :]  # [R, T, T]
    mask = torch.cat([cached[:, None, :].expand(R, T, -1), new], dim=2)[:, None]  # [R, 1, T, S+T]
    offsets = torch.cat([ar[:Tc], torch.ones(N, dtype=ar.dtype, device=dev)])
    return mask, seq_len[:, None] + offsets[None, :], new_valid


def rescue(res: VerifyResult, logits: Tensor, feed: SiblingFeed) -> tuple[VerifyResult, Tensor]:
    """Rows whose chain lost its first draft take a sibling that is the target's own token after
    x0: emitted [sibling, the target's token after it], one draft accepted. Returns the result
    and the sibling taken per row [R] (-1: none). logits: the verify forward's [R, T, V]."""
    Tc = feed.chain
    first = logits[:, 0].argmax(dim=-1)  # [R] the target's token after x0
    hit = (feed.tokens == first[:, None]) & feed.valid & (res.accepted == 0)[:, None]  # [R, N]
    took = torch.where(hit.any(dim=1), hit.to(torch.int8).argmax(dim=1), torch.full_like(first, -1))
    rows = (took >= 0).nonzero().flatten()
    if rows.numel() == 0:
        return res, took
    j = took[rows]
    bonus = logits[rows, Tc + j].argmax(dim=-1)
    accepted, emitted, num = res.accepted.clone(), res.emitted.clone(), res.num_emitted.clone()
    accepted[rows], num[rows] = 1, 2
    emitted[rows, 0], emitted[rows, 1] = feed.tokens[rows, j], bonus
    return VerifyResult(accepted=accepted, emitted=emitted, num_emitted=num), took


def taken_columns(took: Tensor, feed: SiblingFeed) -> tuple[Tensor, Tensor]:
    """(rows that took a sibling, the feed column each one's sibling sits in): what moves to column
    1, x1's, so that every row keeps a prefix of the feed (`TargetAdapter.relocate`)."""
    rows = (took >= 0).nonzero().flatten()
    return rows, feed.chain + took[rows]


@dataclass
class SiblingRate:
    """How many tokens the runners-up brought against the draft probabilities they were verified
    with, over a batch's rounds so far: `plan` scales q by it."""

    promised: float = PRIOR_PROMISED
    taken: float = PRIOR_PROMISED * PRIOR_SCALE

    @property
    def scale(self) -> float:
        return self.taken / self.promised

    def add(self, q: Tensor, feed: SiblingFeed, took: Tensor) -> None:
        """One round's siblings: q [R, 1 + M] as `plan` saw it, the feed, the sibling each row took."""
        n = int(feed.tokens.shape[1])
        self.promised += float((q[:, 1: n + 1].to(torch.float64) * feed.valid.to(q.device)).sum())
        self.taken += float((took >= 0).sum())


def measured_width(sps: SPSTable, requests: int) -> int:
    """The widest step (tokens per request) the table measured at `requests` requests."""
    if sps.grid is not None:
        return int(sps.grid.tokens[-1])
    return max(1, int(sps.measured_tokens) // max(1, requests))


def plan(survival: Tensor, ell: Tensor, q: Tensor, sps: SPSTable, most: int, scale: float = 1.0) -> tuple[int, int]:
    """(L, N): verify at most L chain drafts per row (L ≤ max ℓ) and N siblings, the pair with the
    most expected tokens per second within the table's measured width; of pairs within RESOLUTION
    of the best (which the table cannot tell apart), the narrowest step. Without siblings the chain
    is the policy's own (L = max ℓ): only room for a sibling shortens it.
    survival [R, γ] calibrated; ell [R] the policy's lengths; q [R, 1 + most]: the draft's
    probabilities of x1 and its runners-up at position 1 (`DraftBlock.first_probs`), times `scale`
    (`SiblingRate.scale`) for what a runner-up brings."""
    R, top = int(ell.shape[0]), int(ell.max())
    most = min(most, int(q.shape[1]) - 1)
    if most <= 0 or top <= 0:
        return top, 0
    ell, s = ell.cpu(), survival.to(torch.float64).cpu()
    gamma = s.shape[1]
    levels = torch.arange(top + 1)
    upto = torch.minimum(ell[None, :], levels[:, None])  # [L + 1, R] each row's chain at cap L
    chain = (1.0 + (s[None] * (torch.arange(gamma)[None, None, :] < upto[:, :, None])).sum(-1)).sum(-1)  # [L + 1]
    gain = scale * q.to(torch.float64).cpu()[:, 1: most + 1].cumsum(1)  # [R, most] tokens N siblings bring a row
    rows_with = (upto >= 1).to(torch.float64)  # [L + 1, R] rows that verify a draft (siblings need one)
    tokens = chain[:, None] + torch.cat([torch.zeros(top + 1, 1, dtype=torch.float64), rows_with @ gain], dim=1)
    width = 1 + levels[:, None] + torch.arange(most + 1)[None, :]  # [L + 1, N + 1] tokens per request
    theta = tokens / sps.step_seconds(R, (R * width).to(torch.float64))
    theta[width > max(measured_width(sps, R), 1 + top)] = -1.0  # never wider than measured (the chain alone may be)
    near = theta >= (1.0 - RESOLUTION) * theta.max()
    narrowest = int(width[near].min())
    theta[~near | (width != narrowest)] = -1.0
    best = int(theta.flatten().argmax())
    if best % (most + 1) == 0:  # no sibling pays: the policy's chain as it chose it
        return top, 0
    return best // (most + 1), best % (most + 1)
