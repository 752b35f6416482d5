"""Synthetic round traces with a KNOWN acceptance model (for tests, benchmarks and docs).

Each round of each request draws a true conditional-acceptance logit per position,
`z_k = mean_logit_k + spread · ε_k` (ε ~ N(0, 1)), so the true conditional acceptance is
`σ(z_k)` and the true survival `Π_{i≤k} σ(z_i)`. The simulated confidence head reports
`overconfidence_k · z_k + bias_k`: over-confident when the scale is > 1. STS with
`T_k = overconfidence_k` (bias 0) recovers the true probabilities exactly.
Rounds are verified fully (`static:γ`) unless `verify_length` says otherwise, so the traces also
feed `sweep-scheduler`. Writing them as a trace file is `dsparkctl.formats.trace.write_synthetic_trace`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SyntheticModel:
    gamma: int = 5  # block size γ
    mean_logit: tuple[float, ...] = (2.2, 1.8, 1.5, 1.2, 1.0)  # mean true logit per position
    spread: float = 1.5  # std of the true logit across rounds
    overconfidence: tuple[float, ...] = (2.5, 2.5, 2.5, 2.5, 2.5)  # reported = scale · true + bias
    bias: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        for name in ("mean_logit", "overconfidence", "bias"):
            if len(getattr(self, name)) != self.gamma:
                raise ValueError(f"SyntheticModel.{name} needs {self.gamma} values")


def sample_rounds(model: SyntheticModel, n: int, gen: torch.Generator,
                  verify_length: int | None = None) -> dict[str, torch.Tensor]:
    """n rounds → {"logits" [n, γ] reported, "true_logits" [n, γ], "verify_length" [n], "accepted" [n]}."""
    g = model.gamma
    z = torch.tensor(model.mean_logit, dtype=torch.float64) + model.spread * torch.randn(
        n, g, generator=gen, dtype=torch.float64)
    ok = torch.rand(n, g, generator=gen, dtype=torch.float64) < torch.sigmoid(z)
    ell = torch.full((n,), g if verify_length is None else verify_length, dtype=torch.long)
    ok &= torch.arange(g).unsqueeze(0) < ell.unsqueeze(1)
    acc = torch.cumprod(ok.to(torch.uint8), 1).sum(1).long()
    reported = z * torch.tensor(model.overconfidence, dtype=torch.float64) + torch.tensor(model.bias, dtype=torch.float64)
    return {"logits": reported, "true_logits": z, "verify_length": ell, "accepted": acc}


