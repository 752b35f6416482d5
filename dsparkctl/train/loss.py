"""The DSpark training objective (docs/background.md §7), as pure functions.

For every block (anchor) and slot k = 1..γ, with q = softmax(draft logits incl. Markov bias)
over the draft's vocabulary, p = the target's distribution for the same position, x*_k the
token that follows, c_k the raw confidence logit:

    L = ce_weight · CE(q, x*)  +  l1_weight · Σ_k w_k ‖q_k − p_k‖₁  +  bce_weight · BCE(σ(c_k), c*_k)
    w_k  = exp(−(k−1)/γ)
    c*_k = 1 − ½‖q_k − p_k‖₁   (detached: the overlap the confidence head should predict)
    paper weights: 0.1, 0.9, 1.0

The target distribution arrives sparse, as its top-k (ids mapped into the draft vocabulary,
-1 where the draft cannot emit the id, and probabilities). With P = the top-k set and D = the
draft vocabulary, and p taken as 0 outside its top-k (the cached tail, 1 − Σ_P p, is small and
unattributable):

    ‖q − p‖₁ = Σ_{P∩D} |q − p|  +  Σ_{P∖D} p  +  (1 − Σ_{P∩D} q)

which is exact whenever the tail is 0 (e.g. a one-hot target). The draft vocabulary is the
full target vocabulary or a reduced one (FR-Spec); a token the draft cannot emit costs its
target mass and is left out of the CE term.

Reductions: CE and BCE are means over valid slots (CE over slots whose x* the draft can emit);
the L1 term is Σ_k w_k ‖·‖₁ per block averaged over blocks with at least one valid slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

CE_WEIGHT, L1_WEIGHT, BCE_WEIGHT = 0.1, 0.9, 1.0


def position_weights(gamma: int, device=None) -> Tensor:
    """w_k = exp(-(k-1)/γ) for k = 1..γ.  [γ]"""
    k = torch.arange(gamma, device=device, dtype=torch.float32)
    return torch.exp(-k / gamma)


@dataclass
class LossParts:
    total: Tensor  # scalar, differentiable
    ce: float
    l1: float  # Σ_k w_k ‖q − p‖₁ per block (mean)
    bce: float
    overlap: list[float]  # mean 1 − ½‖q − p‖₁ per slot (teacher-forced β at T=1)
    top1: list[float]  # per slot: share of blocks whose draft argmax is the target token (greedy β)


def sparse_l1(q: Tensor, topk_idx: Tensor, topk_p: Tensor) -> Tensor:
    """‖q − p‖₁ with p given by its top-k.  q: [M, γ, K]; topk_idx: [M, γ, k] draft index or -1;
    topk_p: [M, γ, k] probabilities.  Returns [M, γ]."""
    inside = topk_idx >= 0
    q_at = q.gather(-1, topk_idx.clamp(min=0)) * inside  # [M, γ, k]
    return ((q_at - topk_p).abs() * inside).sum(-1) + (topk_p * ~inside).sum(-1) + (1.0 - q_at.sum(-1))


def loss_counts(target_idx: Tensor, valid: Tensor) -> Tensor:
    """The objective's denominators [3]: valid slots, slots whose x* the draft can emit, blocks.
    A data-parallel step sums them over ranks first, so N ranks × b sequences give exactly the
    loss (and gradient) of one process × N·b."""
    valid = valid.reshape(-1, valid.shape[-1])
    emit = valid & (target_idx.reshape(valid.shape) >= 0)
    return torch.stack([valid.sum(), emit.sum(), valid.any(-1).sum()]).double()


def dspark_loss(draft_logits: Tensor, topk_idx: Tensor, topk_p: Tensor, target_idx: Tensor,
                conf_logits: Tensor | None, valid: Tensor, weights: tuple[float, float, float] = (
                    CE_WEIGHT, L1_WEIGHT, BCE_WEIGHT), counts: Tensor | None = None) -> LossParts:
    """draft_logits: [M, γ, K]; topk_idx/topk_p: [M, γ, k]; target_idx: [M, γ] draft index of x*
    (-1 if outside the draft vocabulary); conf_logits: [M, γ] | None; valid: [M, γ] bool;
    counts: denominators from `loss_counts` (default: this batch's own)."""
    M, g, K = draft_logits.shape
    w_ce, w_l1, w_bce = weights
    vf = valid.float()
    if counts is None:
        counts = loss_counts(target_idx, valid)
    n_slots, n_emit, blocks = (float(c) if float(c) > 0 else 1.0 for c in counts)
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    q = logq.exp()
    l1 = sparse_l1(q, topk_idx, topk_p)  # [M, γ]
    emit = valid & (target_idx >= 0)
    ce = -(logq.gather(-1, target_idx.clamp(min=0)[..., None]).squeeze(-1))  # [M, γ]
    ce_m = (ce * emit).sum() / n_emit
    w = position_weights(g, draft_logits.device)
    l1_m = (l1 * w * vf).sum() / blocks
    total = w_ce * ce_m + w_l1 * l1_m
    overlap = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    bce_v = 0.0
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), overlap, reduction="none")
        bce_m = (bce * vf).sum() / n_slots
        total = total + w_bce * bce_m
        bce_v = float(bce_m.detach())
    per_slot = vf.sum(0).clamp(min=1.0)
    top1 = ((logq.detach().argmax(-1) == target_idx) & valid).float().sum(0) / per_slot
    return LossParts(total=total, ce=float(ce_m.detach()), l1=float(l1_m.detach()), bce=bce_v,
                     overlap=((overlap * vf).sum(0) / per_slot).tolist(), top1=top1.tolist())


def lr_at(step: int, total: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up then cosine decay to lr·min_ratio (step counts from 0)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
