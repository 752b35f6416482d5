"""Head-only refit of a draft's confidence head on frozen features, with greedy labels.

Why. The DSpark objective trains the confidence head against the soft overlap
`c*_k = 1 − ½‖p_k − q_k‖₁` of the two distributions at temperature 1 (train/loss.py). Under greedy
decoding a draft is accepted iff its argmax equals the target's, a different event: the shipped
draft's head, scored on real greedy traces, ranked rounds poorly (position-1 AUROC 0.64) and
was off by a bias that temperature scaling (STS) cannot move. Refitting only the head (a
linear layer on `[h_k ; W1[x_{k-1}]]`, docs/background.md §4) on the labels the engine will see is cheap:
the backbone and heads stay frozen, so the drafts and τ are unchanged.

Data. Teacher forcing on the target's own greedy continuations: for every anchor a of a
continuation and slot k, the features are the draft's final hidden state h_k and the Markov
embedding of the previous TRUE token, and the label is "the draft's argmax at slot k equals the
target's token" — the conditional acceptance of slot k given slots < k were accepted (which,
under greedy, means they equalled the target's tokens, exactly what teacher forcing feeds).

Fit. L2-regularised logistic regression (L-BFGS, full batch), started from the current head.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from dsparkctl.errors import UsageError
from dsparkctl.evaluation.teacher_forced import target_forward
from dsparkctl.models.draft import DSparkDraft


@torch.no_grad()
def confidence_examples(draft: DSparkDraft, model: torch.nn.Module, seqs: Sequence[Sequence[int]],
                        prompt_lens: Sequence[int], batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor, torch.Tensor]:
    """Teacher-forced head inputs and greedy labels over every full-block anchor of every sequence.

    Returns (features `[N, H (+ r)]`, labels `[N]` bool, slot `[N]` long 1..γ, sequence `[N]` long)."""

    if draft.confidence_head is None:
        raise UsageError("the draft has no confidence head to refit", "use a DSpark draft (not DFlash)")
    g = draft.block_size
    feats, labels, slots, seq_ids = [], [], [], []
    dt = next(draft.fc.parameters()).dtype
    for i in range(0, len(seqs), batch_size):
        part = list(range(i, min(i + batch_size, len(seqs))))
        fw = target_forward(model, [seqs[j] for j in part], draft.cfg.target_layer_ids, batch_size)
        for j, (tf, _) in zip(part, fw):
            toks = torch.as_tensor(list(seqs[j]), dtype=torch.long)
            S = toks.numel()
            anchors = torch.arange(prompt_lens[j], max(prompt_lens[j], S - g))
            for c in range(0, anchors.numel(), 64):
                a = anchors[c: c + 64]
                idx = a[:, None] + torch.arange(g + 1)  # [n, γ+1]
                blk = toks[idx]
                hidden = draft.forward_blocks(tf[None].to(dt), blk[None, :, 0], a[None])[0]  # [n, γ, H]
                logits, _ = draft.block_logits(hidden, blk[:, :g])  # [n, γ, K]
                pred = logits.argmax(-1)
                if draft.draft_vocab_ids is not None:
                    pred = draft.draft_vocab_ids[pred]
                f = hidden
                if draft.cfg.confidence_head_with_markov:
                    f = torch.cat([hidden, draft.markov_head.markov_w1(blk[:, :g]).to(hidden.dtype)], dim=-1)
                feats.append(f.reshape(-1, f.shape[-1]).float())
                labels.append((pred == blk[:, 1:]).reshape(-1))
                slots.append(torch.arange(1, g + 1).repeat(a.numel()))
                seq_ids.append(torch.full((a.numel() * g,), j, dtype=torch.long))
    if not feats:
        raise UsageError("no sequence is long enough for one full block", "use longer continuations")
    return torch.cat(feats), torch.cat(labels), torch.cat(slots), torch.cat(seq_ids)


def fit_confidence_head(feats: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        l2: float = 1e-3, steps: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Logistic regression `σ(w·x + b)` on `feats [N, D]`, `labels [N]`, from (`weight [1, D]`, `bias [1]`).

    Features are standardised inside the fit and the result is mapped back, so the returned
    (weight, bias) act on raw features like the head does."""
    x = feats.double()
    mu, sd = x.mean(0), x.std(0).clamp(min=1e-6)
    z = (x - mu) / sd
    y = labels.double()
    w = (weight.double().flatten() * sd).clone().requires_grad_(True)  # the same function, standardised
    b = (bias.double().flatten() + (weight.double().flatten() * mu).sum()).clone().requires_grad_(True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=steps, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(z @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    w_raw = (w.detach() / sd)
    b_raw = b.detach() - (w_raw * mu).sum()
    return w_raw.to(weight.dtype).view_as(weight), b_raw.to(bias.dtype).view_as(bias)
