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

How many (`count`): the N that maximises expected tokens per second of the step, the SPS table
pricing a step of 1 + max ℓ + N tokens per request, a sibling bringing one token with the
probability the draft gives it at position 1. (The shipped draft's runners-up on MT-Bench, teacher-
forced: mean probability 0.134, 0.060, 0.035 against 0.101, 0.052, 0.029 observed, so a little
generous, as its top choice is: 0.59 against 0.42.) Decided from the draft alone, before the
target sees anything.
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

    @property
    def width(self) -> int:
        return self.chain + int(self.tokens.shape[1])


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


def kept_slots(accepted: Tensor, took: Tensor, feed: SiblingFeed) -> tuple[Tensor, Tensor]:
    """(kept [R, T] bool: the feed's slots each row keeps; order [R, T] long: the kept slots first,
    in position order, the index into the forward's outputs for the draft's context)."""
    R, T = accepted.shape[0], feed.width
    ar = torch.arange(T, device=accepted.device)
    kept = ar[None, :] <= accepted[:, None]
    order = ar[None, :].expand(R, T).clone()
    rows = (took >= 0).nonzero().flatten()
    if rows.numel():
        kept[rows] = False
        kept[rows, 0] = True
        kept[rows, feed.chain + took[rows]] = True
        order[rows, 1] = feed.chain + took[rows]
    return kept, order


def count(survival: Tensor, ell: Tensor, q: Tensor, sps: SPSTable, most: int) -> int:
    """The sibling count 0..most with the most expected tokens per second (the smallest such).
    survival [R, γ] calibrated; ell [R]; q [R, 1 + most]: the draft's probabilities of x1 and its
    runners-up at position 1 (`DraftBlock.first_probs`)."""
    R = int(ell.shape[0])
    most = min(most, int(q.shape[1]) - 1)
    ell = ell.cpu()
    if most <= 0 or not bool((ell >= 1).any()):
        return 0
    s = survival.to(torch.float64).cpu()
    chain = (1.0 + (s * (torch.arange(s.shape[1])[None, :] < ell[:, None])).sum(1)).sum()
    gain = (q.to(torch.float64).cpu()[:, 1: most + 1] * (ell >= 1)[:, None]).sum(0).cumsum(0)  # [most]
    tokens = torch.cat([chain[None], chain + gain])  # [most + 1]
    width = 1 + int(ell.max()) + torch.arange(most + 1, dtype=torch.float64)
    theta = tokens / sps.step_seconds(R, R * width)
    return int(theta.argmax())
