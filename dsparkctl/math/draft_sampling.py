"""Semi-autoregressive draft sampling: one parallel backbone pass, then a short serial loop.

Block slot i (0-based) predicts draft token x_{i+1}; x_0 is the anchor (the target's last
token). With a Markov head the loop is

    for k = 1..γ:  logits_k = U_k + bias(x_{k-1}[, h_k, s_{k-1}]);  q_k = warp(logits_k);  x_k ~ q_k
                   (`MarkovHead.step_logits`)

where U_k = base_logits[:, k-1]. Without a head (DFlash) the slots are independent and all γ
tokens are drawn in one vectorised call. `probs` is the warped distribution each x_k was drawn
from: exactly the q that verification needs for its residual.

Reduced draft vocabulary (FR-Spec / EAGLE-3 style): the logits cover K target ids
`vocab_ids` [K] (strictly increasing). Draws are indices into that list and are mapped back to
target ids before they become x_k (the Markov head's W1 is indexed by target ids). `probs`
stays [R, γ, K]; `DraftBlock.full_probs` spreads it over the target vocabulary with zeros
elsewhere, which is the q verification needs: a token outside the subset has q = 0.

Greedy verification never reads q (it compares with the target's argmax), so a caller that
verifies greedily passes `need_probs=False`: nothing is stored, and a greedy draft then takes
the argmax of the logits directly, the very index `draw` finds in the one-hot q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dsparkctl.math.sampling import SamplingParams, draw, warp_probs

__all__ = ["DraftBlock", "sample_block"]


@dataclass
class DraftBlock:
    tokens: Tensor               # [R, γ] long, x_1..x_γ (target ids)
    probs: Tensor | None         # [R, γ, K] float32 warped draft distribution of each x_k (K = V if full);
                                 # None when not asked for (need_probs=False)
    markov_embeds: Tensor | None # [R, γ, r] W1[x_{k-1}] per slot (confidence-head input); None for DFlash
    vocab_ids: Tensor | None = None  # [K] target id of each draft index; None = the full vocabulary
    alternatives: Tensor | None = None  # [R, N] target ids: position 1's runners-up after x_1 (siblings)
    first_probs: Tensor | None = None   # [R, 1 + N] the draft's probabilities of x_1 and those runners-up

    def full_probs(self, vocab_size: int) -> Tensor:
        """q over the target vocabulary [R, γ, V]: zero outside the draft's subset."""
        if self.probs is None:
            raise ValueError("this block was drafted without its probabilities (need_probs=False)")
        if self.vocab_ids is None:
            return self.probs
        R, g, _ = self.probs.shape
        full = self.probs.new_zeros(R, g, vocab_size)
        return full.index_copy_(2, self.vocab_ids, self.probs)


def sample_block(
    base_logits: Tensor,          # [R, γ, V] U_1..U_γ from the draft's one parallel forward
    anchors: Tensor,              # [R] long, x_0
    head,                         # MarkovHead | None (None = DFlash)
    hidden: Tensor | None,        # [R, γ, H] backbone hidden per slot (gated/rnn heads)
    params: SamplingParams,
    generator: torch.Generator | None,
    vocab_ids: Tensor | None = None,  # [K] target ids of the logits' columns; None = full vocabulary
    need_probs: bool = True,      # False: the block's q is never read (greedy verification); not stored
    alternatives: int = 0,        # greedy: also keep position 1's next-best N tokens (engine/siblings.py)
) -> DraftBlock:
    """Run the serial Markov loop (or the parallel DFlash draw) and return the draft block."""
    R, g, V = base_logits.shape
    argmax_only = params.greedy and not need_probs  # the argmax of the logits is the one-hot q's index

    def to_target(idx: Tensor) -> Tensor:
        return idx if vocab_ids is None else vocab_ids[idx]

    if head is None:
        if argmax_only:
            idx = base_logits.argmax(dim=-1)
            alts, first = _runners_up(base_logits[:, 0], idx[:, 0], alternatives, vocab_ids) if alternatives else (None, None)
            return DraftBlock(tokens=to_target(idx), probs=None, markov_embeds=None, vocab_ids=vocab_ids,
                              alternatives=alts, first_probs=first)
        probs = warp_probs(base_logits, params)                              # [R, γ, K]
        return DraftBlock(tokens=to_target(draw(probs, params, generator, warped=True)),
                          probs=probs if need_probs else None, markov_embeds=None, vocab_ids=vocab_ids)

    if argmax_only and head.kind == "vanilla" and not torch.is_grad_enabled():
        fast = _greedy_vanilla(base_logits, anchors, head, vocab_ids, alternatives)
        if fast is not None:
            return fast
    runners_up = None
    device = base_logits.device
    tokens = torch.empty((R, g), dtype=torch.long, device=device)
    probs = torch.empty((R, g, V), dtype=torch.float32, device=device) if need_probs else None
    embeds = torch.empty((R, g, head.rank), dtype=head.markov_w1.weight.dtype, device=device)
    state_dtype = hidden.dtype if hidden is not None else head.markov_w1.weight.dtype
    state = head.init_state(R, device, state_dtype)
    prev = anchors.to(device=device, dtype=torch.long)
    with torch.no_grad():
        for k in range(g):
            logits, embed, state = head.step_logits(base_logits[:, k], prev, None if hidden is None else hidden[:, k],
                                                    state)                   # new tensor [R, V]
            if argmax_only:
                idx = logits.argmax(dim=-1)                                  # [R]
                if k == 0 and alternatives:
                    runners_up = _runners_up(logits, idx, alternatives, vocab_ids)
            else:
                p = warp_probs(logits, params)                               # [R, K] float32
                idx = draw(p, params, generator, warped=True)                # [R]
                if probs is not None:
                    probs[:, k] = p
            prev = to_target(idx)                                            # [R] target ids
            tokens[:, k] = prev
            embeds[:, k] = embed
    alts, first = runners_up if runners_up is not None else (None, None)
    return DraftBlock(tokens=tokens, probs=probs, markov_embeds=embeds, vocab_ids=vocab_ids,
                      alternatives=alts, first_probs=first)


def _runners_up(logits: Tensor, idx: Tensor, n: int, vocab_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """Position 1's N best tokens after the chosen `idx` (target ids) and the draft's probabilities
    of [idx, those N] → ([R, N], [R, 1 + N]). `idx` is the argmax: ties resolve as the argmax did."""
    n = min(n, logits.shape[-1] - 1)
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.topk(n + 1, dim=-1).indices  # [R, n + 1]
    others = top != idx[:, None]
    pick = others.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :n]  # the first n that are not idx
    alt = top.gather(1, pick)
    first = torch.cat([probs.gather(1, idx[:, None]), probs.gather(1, alt)], dim=1)
    return (alt if vocab_ids is None else vocab_ids[alt]), first


def _greedy_vanilla(base_logits: Tensor, anchors: Tensor, head, vocab_ids: Tensor | None,
                    alternatives: int = 0) -> DraftBlock | None:
    """The serial loop for the common inference case (greedy draft, vanilla head, no probs kept):
    per step one lookup, one addmm over W2ᵀ and one argmax, the blocks stacked at the end. The
    same values as `MarkovHead.step_logits`' inference path; None where that path would not run."""
    w1, w2 = head.markov_w1.weight, getattr(head.markov_w2, "weight", None)
    if not isinstance(w2, Tensor) or not (base_logits.dtype == w2.dtype == w1.dtype):
        return None
    w2t = head._w2_t(w2)
    prev = anchors.to(device=base_logits.device, dtype=torch.long)
    tokens, embeds, runners_up = [], [], (None, None)
    for k in range(base_logits.shape[1]):
        embed = F.embedding(prev, w1)                                       # [R, r] W1[x_{k-1}]
        logits = torch.addmm(base_logits[:, k], embed, w2t)
        idx = logits.argmax(dim=-1)                                         # [R]
        if k == 0 and alternatives:
            runners_up = _runners_up(logits, idx, alternatives, vocab_ids)
        prev = idx if vocab_ids is None else vocab_ids[idx]
        tokens.append(prev)
        embeds.append(embed)
    return DraftBlock(tokens=torch.stack(tokens, dim=1), probs=None, markov_embeds=torch.stack(embeds, dim=1),
                      vocab_ids=vocab_ids, alternatives=runners_up[0], first_probs=runners_up[1])
