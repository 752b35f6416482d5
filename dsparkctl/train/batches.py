"""Training batches: full-block anchors sampled in the cached sequences, assembled into a `Batch`.

A sequence's anchors are the positions a with a whole block inside its response
(prompt_len <= a <= S-1-γ); a step samples up to `anchors_per_sequence` distinct ones per
sequence with the trainer's generator, the same way on every rank, so a resumed run draws the
same batches as an uninterrupted one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsparkctl.train.parts import Sequence


@dataclass
class Batch:
    features: torch.Tensor  # [B, S, F] float32 (zero padded), already scaled by the tap scales
    anchor_ids: torch.Tensor  # [B, N]
    anchor_pos: torch.Tensor  # [B, N]
    prev_tokens: torch.Tensor  # [B, N, γ]  (anchor, x*_1..x*_{γ-1})
    target_idx: torch.Tensor  # [B, N, γ]  draft-vocabulary index of x*_1..x*_γ (-1: not emittable)
    topk_idx: torch.Tensor  # [B, N, γ, k] draft-vocabulary index of the target's top-k (-1: outside)
    topk_p: torch.Tensor  # [B, N, γ, k] float32 target probabilities of those ids
    valid: torch.Tensor  # [B, N, γ] bool

    def to(self, device: torch.device) -> "Batch":
        return Batch(**{k: v.to(device, non_blocking=True) for k, v in self.__dict__.items()})


def anchor_range(seq: Sequence, gamma: int) -> tuple[int, int]:
    """Anchors a with a full block inside the sequence: prompt_len <= a <= S-1-γ (may be empty)."""
    return seq.prompt_len, len(seq.tokens) - 1 - gamma


def sample_anchors(seqs: list[Sequence], n_anchors: int, gamma: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to n_anchors distinct full-block anchors per sequence, sorted: (positions [B, N], valid [B, N])."""
    B = len(seqs)
    a_pos = torch.zeros(B, n_anchors, dtype=torch.long)
    ok = torch.zeros(B, n_anchors, dtype=torch.bool)
    for b, s in enumerate(seqs):
        lo, hi = anchor_range(s, gamma)
        count = max(0, hi - lo + 1)
        pick = torch.randperm(count, generator=gen)[:n_anchors] + lo if count else torch.zeros(0, dtype=torch.long)
        a_pos[b, : len(pick)] = torch.sort(pick).values
        ok[b, : len(pick)] = True
        a_pos[b, len(pick):] = lo if count else 0
    return a_pos, ok


def make_batch(seqs: list[Sequence], n_anchors: int, gamma: int, gen: torch.Generator, to_draft: torch.Tensor,
               feature_scale: torch.Tensor | None = None, rows: slice | None = None) -> Batch:
    """Sample anchors for every sequence (the generator advances the same way on every rank), then
    assemble the batch of `rows` (this rank's share; all by default).

    to_draft: [V] long, the draft-vocabulary index of each target id (-1 outside the subset).
    Context is cut at the last sampled anchor (later positions are never attended to)."""
    a_pos, ok = sample_anchors(seqs, n_anchors, gamma, gen)
    if rows is not None:
        seqs, a_pos, ok = seqs[rows], a_pos[rows], ok[rows]
    B = len(seqs)
    S = max(1, int(a_pos.max())) if B else 1
    F_ = seqs[0].features.shape[1]
    k = seqs[0].topk_ids.shape[1]
    feats = torch.zeros(B, S, F_)
    toks = torch.zeros(B, n_anchors, gamma + 1, dtype=torch.long)
    tk_ids = torch.zeros(B, n_anchors, gamma, k, dtype=torch.long)
    tk_lp = torch.full((B, n_anchors, gamma, k), -math.inf)
    steps = torch.arange(gamma + 1)
    for b, s in enumerate(seqs):
        n = min(S, len(s.features))
        feats[b, :n] = s.features[:n].float()
        idx = (a_pos[b][:, None] + steps).clamp(max=len(s.tokens) - 1)  # [N, γ+1]
        toks[b] = s.tokens[idx]
        # slot k predicts the token at a+k; top-k row j holds the target's distribution for the token at P+j
        rows_k = (idx[:, 1:] - s.prompt_len).clamp(0, len(s.topk_ids) - 1)
        tk_ids[b] = s.topk_ids[rows_k].long()
        tk_lp[b] = s.topk_logp[rows_k].float()
    if feature_scale is not None:
        feats *= feature_scale
    valid = ok[:, :, None].expand(B, n_anchors, gamma).clone()
    return Batch(features=feats, anchor_ids=toks[:, :, 0], anchor_pos=a_pos, prev_tokens=toks[:, :, :gamma],
                 target_idx=to_draft[toks[:, :, 1:]], topk_idx=to_draft[tk_ids], topk_p=tk_lp.exp(), valid=valid)
