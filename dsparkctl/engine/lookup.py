"""Context lookup: a block copied from where the text already went after the same tokens.

When a row's last n tokens (n = 4, 3, then 2; the anchor is the last of them) occurred earlier in
its prompt or its output, the tokens that followed the latest such occurrence are proposed as
the block instead of the draft's (prompt lookup / n-gram speculation, as vLLM and SGLang
offer it). Where the copy reaches past the anchor it goes on with itself, so a loop of period p
is proposed whole. Small targets decoding greedily repeat themselves often; the draft, which
sees the target's features and not its tokens, copies badly (docs/generate.md, "Context lookup").

Greedy verification only: the proposal is a token, not a distribution, and verification is the
same exact argmax check as for the draft's block, so output is unchanged (lossless).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dsparkctl.errors import UsageError, option

MATCH_LENGTHS = (4, 3, 2)  # longest first: a longer match is right more often


def continuation(hist: Tensor, gamma: int, lengths: Sequence[int] = MATCH_LENGTHS) -> Tensor | None:
    """The γ tokens that followed the latest earlier occurrence of `hist`'s last n tokens (the
    longest n that matches), continued periodically past the end; None without a match.
    hist: [L] long, ending with the anchor."""
    L = int(hist.shape[0])
    for n in lengths:
        if L <= n:
            continue
        windows = hist[: L - 1].unfold(0, n, 1)  # windows ending at j = i+n-1 <= L-2 (never the suffix itself)
        hit = (windows == hist[L - n:]).all(dim=1).nonzero()
        if hit.numel():
            j = int(hit[-1]) + n - 1  # the latest occurrence's last position
            period = L - 1 - j
            return hist[j + 1 + torch.arange(gamma, device=hist.device) % period]
    return None


@dataclass
class History:
    """Every live row's tokens so far (prompt, then output up to and including the anchor)."""

    tokens: Tensor  # [n, capacity] long
    length: Tensor  # [n] long

    @classmethod
    def start(cls, prompts: Sequence[Sequence[int]], anchors: Tensor, capacity: int) -> "History":
        toks = torch.zeros(len(prompts), capacity, dtype=torch.long, device=anchors.device)
        for r, p in enumerate(prompts):
            toks[r, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
            toks[r, len(p)] = anchors[r]
        length = torch.tensor([len(p) + 1 for p in prompts], dtype=torch.long, device=anchors.device)
        return cls(toks, length)

    def append(self, emitted: Tensor, kept: Tensor) -> None:
        """Add each row's first kept[r] tokens of emitted [n, T]."""
        cols = torch.arange(emitted.shape[1], device=emitted.device)
        r, c = (cols[None, :] < kept[:, None]).nonzero(as_tuple=True)
        self.tokens[r, self.length[r] + c] = emitted[r, c]
        self.length = self.length + kept

    def keep(self, rows: Tensor) -> None:
        self.tokens, self.length = self.tokens[rows], self.length[rows]

    def proposals(self, gamma: int) -> tuple[Tensor, Tensor]:
        """(tokens [n, γ], found [n] bool): each row's lookup block, where it has one."""
        n = self.length.numel()
        out = torch.zeros(n, gamma, dtype=torch.long, device=self.tokens.device)
        found = torch.zeros(n, dtype=torch.bool, device=self.tokens.device)
        for r, L in enumerate(self.length.tolist()):
            block = continuation(self.tokens[r, :L], gamma)
            if block is not None:
                out[r], found[r] = block, True
        return out, found


def lookup_betas(tokens: Tensor, start: int, count: int, gamma: int) -> tuple[Tensor, Tensor]:
    """Teacher-forced greedy outcome of the lookup at anchors start..start+count-1 of one
    sequence: (hits [count, γ] float (1 where the copied token is the next one), found [count])."""
    hits = torch.zeros(count, gamma)
    found = torch.zeros(count, dtype=torch.bool)
    t = tokens.cpu()
    for i in range(count):
        a = start + i
        block = continuation(t[: a + 1], gamma)
        if block is not None:
            found[i] = True
            hits[i] = (block == t[a + 1: a + 1 + gamma]).float()
    return hits, found


def lookup_setting(asked: bool | None, greedy: bool, trace: bool) -> bool:
    """`--lookup`: on by default where it applies (greedy decoding without a trace); asked for
    where it cannot apply, refused rather than dropped."""
    if asked is None:
        return greedy and not trace
    if asked and not greedy:
        raise UsageError(f"{option('lookup')} copies blocks only under greedy decoding: sampled, a copy would "
                         "not be drawn from the draft's distribution", f"drop {option('lookup')}, or use "
                         f"{option('temperature')} 0")
    if asked and trace:
        raise UsageError(f"{option('trace')} records the draft's own rounds (for calibrate and sweep-scheduler); "
                         "context lookup's would mix into them", f"drop {option('lookup')}, or {option('trace')}")
    return asked
