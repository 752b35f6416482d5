"""The DSpark training objective (DSPARK.md "Training objective"), as one pure function.

For every block (anchor) and slot k = 1..γ, with p_d = softmax(draft logits incl. Markov bias),
p_t = softmax(target logits) for the same position, x*_k the target's token, c_k the raw
confidence logit:

    L = 0.1 · CE(p_d, x*)  +  0.9 · Σ_k w_k ‖p_d,k − p_t,k‖₁  +  1.0 · BCE(σ(c_k), c*_k)
    w_k  = exp(−(k−1)/γ)
    c*_k = 1 − ½‖p_d,k − p_t,k‖₁   (detached: the overlap the confidence head should predict)

Reductions: CE and BCE are means over valid slots; the L1 term is Σ_k w_k ‖·‖₁ per block
averaged over blocks with at least one valid slot (a block sums only its valid slots).
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
    l1: float  # Σ_k w_k ‖p_d − p_t‖₁ per block (mean)
    bce: float
    overlap: list[float]  # mean 1 − ½‖p_d − p_t‖₁ per slot (teacher-forced β at T=1)


def dspark_loss(draft_logits: Tensor, target_logits: Tensor, target_tokens: Tensor,
                conf_logits: Tensor | None, valid: Tensor) -> LossParts:
    """draft_logits, target_logits: [M, γ, V]; target_tokens: [M, γ]; conf_logits: [M, γ] | None;
    valid: [M, γ] bool (slot has a real target token)."""
    M, g, V = draft_logits.shape
    vf = valid.float()
    n_slots = vf.sum().clamp(min=1.0)
    logp_d = F.log_softmax(draft_logits.float(), dim=-1)
    p_d = logp_d.exp()
    p_t = F.softmax(target_logits.float(), dim=-1)
    l1 = (p_d - p_t).abs().sum(-1)  # [M, γ]
    ce = -(logp_d.gather(-1, target_tokens.clamp(min=0)[..., None]).squeeze(-1))  # [M, γ]
    ce_m = (ce * vf).sum() / n_slots
    w = position_weights(g, draft_logits.device)
    blocks = valid.any(-1).float().sum().clamp(min=1.0)
    l1_m = (l1 * w * vf).sum() / blocks
    total = CE_WEIGHT * ce_m + L1_WEIGHT * l1_m
    overlap = (1.0 - 0.5 * l1).detach()
    bce_v = 0.0
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), overlap.clamp(0, 1), reduction="none")
        bce_m = (bce * vf).sum() / n_slots
        total = total + BCE_WEIGHT * bce_m
        bce_v = float(bce_m.detach())
    per_slot = ((overlap * vf).sum(0) / vf.sum(0).clamp(min=1.0)).tolist()
    return LossParts(total=total, ce=float(ce_m.detach()), l1=float(l1_m.detach()), bce=bce_v, overlap=per_slot)


def lr_at(step: int, total: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up then cosine decay to lr·min_ratio (step counts from 0)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
