"""What drafts really brought: the gate's correction of predicted survivals by realized acceptance.

The skip gate (math/policies.py `_Gated`) estimates what a draft will bring from survivals the
confidence head predicts. Calibrated on one task family, those over-promise on others: on
MT-Bench at 4 requests the gate drafted in 50-74% of steps while a replay of the same rounds with
their real acceptances said drafting lost 6% to plain decoding. Each verified slot (r, k ≤ ℓ_r)
of a drafted step is a trial whose predicted success is the survival s_{r,k} and whose outcome is
known after verification (accepted_r ≥ k). Per position k the gate keeps decayed sums of both,

    seen_k ← d·seen_k + Σ_r s_{r,k}·[ℓ_r ≥ k],   hit_k ← d·hit_k + Σ_r [accepted_r ≥ k]·[ℓ_r ≥ k],

and multiplies its estimated profile by ρ_k = (hit_k + n₀·ρ_{k-1}) / (seen_k + n₀) (ρ_0 = 1): a
position with little evidence takes the ratio of the one before it, i.e. keeps the predicted
conditionals beyond what was verified. The corrected profile is clipped to [0, 1] and made
non-increasing, as survivals are.

Lossless: the observations are of steps already verified, so whether to draft at a step still
depends only on earlier steps (math/policies.py's module doc).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DECAY = 0.95  # per observed drafted step: about the last 20 drafted steps weigh in
PSEUDO = 4.0  # n₀: predicted survival mass after which a position's own evidence outweighs its neighbour's


@dataclass
class Realized:
    """Decayed per-position sums of predicted (`seen`) and realized (`hit`) acceptance `[γ]`."""

    seen: torch.Tensor
    hit: torch.Tensor

    @classmethod
    def empty(cls, gamma: int) -> "Realized":
        return cls(torch.zeros(gamma, dtype=torch.float64), torch.zeros(gamma, dtype=torch.float64))

    def add(self, survival: torch.Tensor, lengths: torch.Tensor, accepted: torch.Tensor) -> None:
        """One drafted step: survivals `[R, γ]` the step was scheduled with, verify lengths `[R]`,
        accepted drafts `[R]` (≤ lengths). A step that verified nothing teaches nothing and does
        not decay what earlier steps taught."""
        survival, lengths, accepted = survival.cpu(), lengths.cpu().long(), accepted.cpu().long()
        if not bool((lengths > 0).any()):
            return
        k = torch.arange(1, survival.shape[1] + 1)
        verified = (k[None, :] <= lengths[:, None]).double()  # [R, γ]
        hit = (k[None, :] <= accepted[:, None]).double() * verified
        self.seen = DECAY * self.seen + (survival.double() * verified).sum(0)
        self.hit = DECAY * self.hit + hit.sum(0)

    def ratio(self) -> torch.Tensor:
        """ρ `[γ]`: realized over predicted acceptance per position, shrunk toward the position before."""
        out = torch.empty_like(self.seen)
        before = 1.0
        for k in range(out.numel()):
            before = float((self.hit[k] + PSEUDO * before) / (self.seen[k] + PSEUDO))
            out[k] = before
        return out

    def correct(self, profile: torch.Tensor) -> torch.Tensor:
        """The estimated survival profile `[γ]` with what verification showed: ρ·profile, in [0, 1],
        non-increasing."""
        return torch.cummin((profile.double().cpu() * self.ratio()).clamp(0.0, 1.0), dim=0).values
