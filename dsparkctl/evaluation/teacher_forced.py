"""Teacher-forced acceptance: the analytic per-position rate over every anchor at once.

For a target continuation x (prompt + response) and every anchor position a in the response
with a full block (a + γ <= S - 1), the draft is conditioned on the target's own prefix:
context = target features of positions < a, previous tokens = (x_a, x_{a+1}, ..., x_{a+γ-1}).
With q_k the draft's warped distribution for slot k and p_k the target's warped distribution
at position a+k-1 (both at the evaluation temperature; greedy = one-hot argmax):

    β_k(a) = Σ_v min(p_k, q_k) = 1 − ½‖p_k − q_k‖₁          (probability slot k is accepted)
    s_j(a) = Π_{i≤j} β_i(a)                                   (probability drafts 1..j all pass)

Aggregated over anchors, the same estimands `AcceptanceStats` measures live, through the same
definitions (math/stats.py) applied to expected counts: an anchor is a fully verified round that
reaches position j with probability s_{j-1}(a) and accepts it with probability s_j(a), so
    survival    a_j = Σ_a s_j(a) / anchors                (`survival_full`)
    conditional c_j = Σ_a s_j(a) / Σ_a s_{j-1}(a)         (`conditional_acceptance`; s_0 = 1)
    τ           = 1 + Σ_j a_j                             (`tau_full`: full verification, bonus included)
Intervals are 95% cluster-robust (prompts are the clusters) delta-method intervals.

With context lookup (greedy; engine/lookup.py), an anchor whose prefix repeats its last 2–4
tokens earlier is scored by the block copied from there instead of the draft's: β_k(a) = 1 where
the copied token is x_{a+k}. The top-level figures stay the draft's own; the pair's are kept
beside them (`with_lookup`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from dsparkctl.distributed import DATA_PARALLEL, Split
from dsparkctl.engine.lookup import lookup_betas
from dsparkctl.math.sampling import SamplingParams, warp_probs
from dsparkctl.math.stats import conditional_acceptance, survival_full, tau_full
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.target import forward_taps

FORMAT = "dsparkctl-teacher-forced/1"


def beta_from_l1(l1: torch.Tensor) -> torch.Tensor:
    """β = 1 − ½‖p − q‖₁, the probability a slot is accepted, from the L1 distance of the target's
    and the draft's distributions (clamped against rounding): the one definition of β."""
    return (1.0 - 0.5 * l1).clamp(0.0, 1.0)


def anchor_block_logits(draft: DSparkDraft, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                        chunk: int = 64, trim_context: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The draft's block logits at every anchor, `chunk` anchors at a time: (idx [n, γ+1] the
    positions a..a+γ of each block, logits [n, γ, K]). feats: [1, S', F] the tapped target
    features, on the draft's device; `trim_context` passes only the features before the last anchor."""
    g = draft.block_size
    dev = feats.device
    for i in range(0, len(anchors), chunk):
        a = anchors[i: i + chunk]  # [n]
        idx = a[:, None] + torch.arange(g + 1, device=a.device)  # [n, γ+1]
        toks = tokens[idx]
        ctx = feats[:, : int(a.max())] if trim_context else feats
        hidden = draft.forward_blocks(ctx, toks[None, :, 0].to(dev), a[None].to(dev))[0]  # [n, γ, H]
        logits, _ = draft.block_logits(hidden, toks[:, :g].to(dev))  # [n, γ, K]
        yield idx, logits


@torch.no_grad()
def sequence_betas(draft: DSparkDraft, tokens: torch.Tensor, features: torch.Tensor, target_logits: torch.Tensor,
                   start: int, params: SamplingParams, chunk: int = 64) -> torch.Tensor:
    """β for every full-block anchor of one sequence.

    tokens: [S] long; features: [S', n_taps*H] tapped target outputs for positions 0..S'-1 (S' >= S-1);
    target_logits: [S', V] target logits at those positions; start: first anchor position
    (the prompt length). Returns β [A, γ] float32 for anchors a = start .. S-1-γ (A may be 0).
    """
    g = draft.block_size
    S = int(tokens.shape[0])
    anchors = torch.arange(start, max(start, S - g), device=tokens.device)  # a + γ <= S - 1 (none if too short)
    dt = next(draft.fc.parameters()).dtype
    out = []
    for idx, logits in anchor_block_logits(draft, features[None].to(dt), tokens, anchors, chunk):
        q = draft.full_vocab(warp_probs(logits.float(), params))  # [n, γ, V]
        p = warp_probs(target_logits[idx[:, :g]].float(), params)
        out.append(beta_from_l1((p - q).abs().sum(-1)))
    if not out:
        return torch.zeros(0, g)
    return torch.cat(out).float().cpu()


@dataclass
class TeacherForcedStats:
    """Per-sequence sums of s_j(a), kept so that results merge and intervals cluster by prompt."""

    block_size: int
    sums: list[list[float]] = field(default_factory=list)  # per sequence: [Σ_a s_1(a), ..., Σ_a s_γ(a)]
    counts: list[int] = field(default_factory=list)  # per sequence: anchors
    with_lookup: "TeacherForcedStats | None" = None  # with context lookup: the draft and the lookup together
    looked_up: int = 0  # with context lookup: anchors the lookup's block scores in the pair

    def add(self, betas: torch.Tensor) -> None:
        """betas: [A, γ] for one sequence (A may be 0: nothing recorded)."""
        if betas.shape[0] == 0:
            return
        s = torch.cumprod(betas.double(), dim=1)  # [A, γ]
        self.sums.append(s.sum(0).tolist())
        self.counts.append(int(betas.shape[0]))

    @property
    def anchors(self) -> int:
        return int(sum(self.counts))

    @property
    def positions(self) -> int:
        """Evaluated (anchor, slot) pairs."""
        return self.anchors * self.block_size

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        S = np.asarray(self.sums, dtype=np.float64).reshape(-1, self.block_size)  # [C, γ]
        n = np.asarray(self.counts, dtype=np.float64)  # [C]
        S0 = np.concatenate([n[:, None], S], axis=1)  # [C, γ+1] with s_0 = 1
        return S0, n

    def survival(self) -> list[float | None]:
        if not self.counts:
            return [None] * self.block_size
        S0, n = self._arrays()
        return survival_full(S0[:, 1:].sum(0), n.sum())

    def conditional(self) -> list[float | None]:
        if not self.counts:
            return [None] * self.block_size
        S0, _ = self._arrays()
        return conditional_acceptance(S0[:, 1:].sum(0), S0[:, :-1].sum(0))

    @property
    def tau(self) -> float | None:
        return tau_full(self.survival())

    @staticmethod
    def _ratio_se(num: np.ndarray, den: np.ndarray) -> tuple[float, float]:
        """Σnum/Σden and its cluster-robust delta-method standard error (clusters = rows; 0 for one row)."""
        C = len(num)
        r = num.sum() / den.sum()
        se = math.sqrt(C / (C - 1) * ((num - r * den) ** 2).sum()) / den.sum() if C > 1 else 0.0
        return float(r), float(se)

    @classmethod
    def _ratio_interval(cls, num: np.ndarray, den: np.ndarray, z: float = 1.96) -> tuple[float, float] | None:
        """Interval for a rate Σnum/Σden, clipped to [0, 1]; (0, 1) from a single cluster."""
        if len(num) == 0 or den.sum() <= 0:
            return None
        if len(num) < 2:
            return (0.0, 1.0)
        r, se = cls._ratio_se(num, den)
        return (max(0.0, r - z * se), min(1.0, r + z * se))

    def conditional_interval(self, z: float = 1.96) -> list[tuple[float, float] | None]:
        if not self.counts:
            return [None] * self.block_size
        S0, _ = self._arrays()
        return [self._ratio_interval(S0[:, j + 1], S0[:, j], z) for j in range(self.block_size)]

    def survival_interval(self, z: float = 1.96) -> list[tuple[float, float] | None]:
        if not self.counts:
            return [None] * self.block_size
        S0, n = self._arrays()
        return [self._ratio_interval(S0[:, j + 1], n, z) for j in range(self.block_size)]

    def tau_interval(self, z: float = 1.96) -> tuple[float, float] | None:
        """τ = 1 + Σ_a Σ_j s_j(a) / anchors; τ - 1 lies in [0, γ], so it is clipped there, not to [0, 1]."""
        if not self.counts:
            return None
        S0, n = self._arrays()
        num = S0[:, 1:].sum(1)
        if n.sum() <= 0:
            return None
        r, se = self._ratio_se(num, n)
        return (1.0 + max(0.0, r - z * se), 1.0 + min(float(self.block_size), r + z * se))

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT, "block_size": self.block_size, "sequences": len(self.counts),
               "anchors": self.anchors, "tau": self.tau, "tau_interval": self.tau_interval(),
               "conditional": self.conditional(), "conditional_interval": self.conditional_interval(),
               "survival": self.survival(), "survival_interval": self.survival_interval()}
        if self.with_lookup is not None:
            out["lookup"] = {"anchors_looked_up": self.looked_up, "with_lookup": self.with_lookup.to_json()}
        return out


@torch.no_grad()
def target_forward(model: Any, seqs: Sequence[Sequence[int]], layer_ids: Sequence[int],
                   batch_size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Full-sequence target forward: per sequence (features [S, n_taps*H], logits [S, V] float32)."""
    dev = next(model.parameters()).device
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(0, len(seqs), batch_size):
        chunk = [list(s) for s in seqs[i: i + batch_size]]
        L = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long, device=dev)
        att = torch.zeros(len(chunk), L, dtype=torch.long, device=dev)
        for r, s in enumerate(chunk):  # right padding: real positions start at 0
            ids[r, : len(s)] = torch.tensor(s, device=dev)
            att[r, : len(s)] = 1
        res, feats = forward_taps(model, layer_ids, dev, input_ids=ids, attention_mask=att)
        for r, s in enumerate(chunk):
            out.append((feats[r, : len(s)], res.logits[r, : len(s)].float()))
    return out


def evaluate_sequences(draft: DSparkDraft, model: Any, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                       params: SamplingParams, batch_size: int = 8, split: Split = DATA_PARALLEL,
                       lookup: bool = False) -> TeacherForcedStats:
    """Teacher-forced statistics of `draft` on target continuations `seqs` (prompt + response ids);
    with `lookup` (greedy only) those of the draft with context lookup beside them (`with_lookup`).

    Under torchrun the sequences are shared among ranks as `split` says and every rank gets the
    merged result, with sequences in their original order (so intervals are the one-process ones)."""
    lookup = lookup and params.greedy
    order = split.mine(range(len(seqs)))
    per_seq: dict[int, torch.Tensor] = {}
    for i in range(0, len(order), batch_size):
        part = order[i: i + batch_size]
        fw = target_forward(model, [seqs[j] for j in part], draft.cfg.target_layer_ids, batch_size)
        for j, (feats, logits) in zip(part, fw):
            toks = torch.as_tensor(list(seqs[j]), dtype=torch.long, device=feats.device)
            alone = sequence_betas(draft, toks, feats, logits, prompt_lens[j], params)
            hits, found = lookup_betas(toks, prompt_lens[j], alone.shape[0], draft.block_size) if lookup else (
                alone, torch.zeros(alone.shape[0], dtype=torch.bool))
            pair = torch.where(found[:, None], hits, alone)
            per_seq[j] = torch.stack([pair, alone, found[:, None].expand_as(alone).float()])  # [3, A, γ]
    for other in split.merged(per_seq):
        per_seq.update(other)
    stats = TeacherForcedStats(block_size=draft.block_size)
    pair = TeacherForcedStats(block_size=draft.block_size)
    for j in range(len(seqs)):
        pair.add(per_seq[j][0])
        stats.add(per_seq[j][1])
        stats.looked_up += int(per_seq[j][2][:, 0].sum()) if per_seq[j].shape[1] else 0
    if lookup:
        stats.with_lookup = pair
    return stats
