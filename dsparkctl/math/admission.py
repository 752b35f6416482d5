"""Admission: from confidence logits to the drafts a step verifies, and what that is worth.

Terms (docs/background.md §3, §6): conditional confidence `c_{r,k} = σ(logit_{r,k} / T_k)`, survival estimate
`a_{r,j} = Π_{k≤j} c_{r,k}` (non-increasing in j), verify length `ℓ_r ∈ {0..γ}`, batch tokens
`B = Σ_r (1 + ℓ_r)`, expected tokens `τ* = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j})`, throughput
`Θ = τ* · SPS(B)`.

Losslessness. The Leviathan rule keeps the output exact only if the decision to verify draft
`x_k` does not depend on `x_k` itself (a non-anticipating stopping rule). `c_k` sees `x_{k-1}` but
not `x_k`; `c_{k+1}` (hence `a_{r,k+1}`) does see `x_k`. So a rule is lossless when whether
`(r, k)` is admitted is decided by candidates that rank no later than `(r, k)`.

Candidate order. All `(r, j)` are sorted by `a_{r,j}` descending, ties broken by smaller `j`,
then smaller `r` (a stable sort of the j-major layout). Because `a` is non-increasing in `j`,
every prefix of that order is a per-request prefix, and the rank of `(r, k)` depends only on
candidates of OTHER requests and `(r, j<k)` — never on `x_k`.

Padded steps. dsparkctl's engine verifies a step as one `[R, 1 + max ℓ]` rectangle, so with a
padded SPS table (`SPSTable.padded`) a draft below the step's longest verify costs nothing and one
beyond it costs a whole level: the Θ-searching policies then admit whole levels (every request
verifies the same L), in the order of `admission`, which is non-anticipating in the same way.

Every batched function takes survivals `[G, R, γ]`: G independent batches (engine steps) of R
requests, so the audit and the sweep run many steps in one call. The policies that use these
pieces are in math/policies.py.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from dsparkctl.errors import InputError, UsageError
from dsparkctl.math.sps import SPSTable


def check_temperatures(temperatures: torch.Tensor | Sequence[float] | None, gamma: int) -> torch.Tensor:
    """Per-position STS temperatures `[γ]` (default all 1); refuse a wrong length or T ≤ 0."""
    if temperatures is None:
        return torch.ones(gamma, dtype=torch.float64)
    t = torch.as_tensor(temperatures, dtype=torch.float64).flatten()
    if t.numel() != gamma:
        raise UsageError(f"temperatures are for block size {t.numel()} but the drafts have block size {gamma}",
                         "calibrate on traces with the same block size")
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise UsageError(f"temperatures must be positive finite numbers, got {t.tolist()}",
                         "refit them on traces of this draft")
    return t


def survival_from_logits(conf_logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """Survival `a = cumprod(σ(logit / T))` along the last dim. `conf_logits`: `[..., γ]` → float64 `[..., γ]`."""
    x = conf_logits.to(torch.float64)
    if bool(torch.isnan(x).any()):
        bad = int(torch.isnan(x).reshape(-1, x.shape[-1]).any(-1).sum())
        raise InputError(f"{bad} request(s) have no confidence logits (NaN)",
                         "this policy needs a confidence head; use static:K for drafts without one")
    t = check_temperatures(temperatures, x.shape[-1])
    return torch.cumprod(torch.sigmoid(x / t), dim=-1)


def sorted_candidates(survival: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort every batch's candidates by survival, descending, ties by (j, r).

    survival: `[G, R, γ]` with values in [0, 1]. Returns (values `[G, R·γ]`, request index
    `[G, R·γ]` long). Implementation: one int64 key per candidate = the survival's IEEE bits
    (monotone for non-negative floats) with the low `b` mantissa bits replaced by the j-major
    index (`b` = bits needed for R·γ, so ≥ 31 mantissa bits of the value are kept; values closer
    than 2^-31 relative count as tied). Keys are unique, so an unstable value sort is
    deterministic; on CPU numpy's SIMD sort does it in ~0.2 ms for 20k candidates.
    """
    G, R, gamma = survival.shape
    n = R * gamma
    flat = survival.to(torch.float64).transpose(1, 2).reshape(G, n).contiguous()  # j-major: j·R + r
    ib = max(1, (n - 1).bit_length())
    top = (1 << (63 - ib)) - 1
    if flat.device.type == "cpu":
        bits = flat.numpy().view(np.int64)
        key = ((top - (bits >> ib)) << ib) | np.arange(n, dtype=np.int64)
        key.sort(axis=1)
        order = torch.from_numpy(key & ((1 << ib) - 1))
    else:
        bits = flat.view(torch.int64)
        key = ((top - (bits >> ib)) << ib) | torch.arange(n, device=flat.device)
        order = torch.sort(key, dim=1).values & ((1 << ib) - 1)
    return flat.gather(1, order), order % R


def theta_curve(vals: torch.Tensor, R: int, sps: SPSTable) -> torch.Tensor:
    """Θ(m) for admitting the top-m candidates, m = 0..R·γ, in tokens per second of a drafted
    step (B = R + m). vals: `[G, R·γ]` → `[G, R·γ + 1]`."""
    G, n = vals.shape
    tau = torch.empty(G, n + 1, dtype=vals.dtype)
    tau[:, 0] = R
    torch.cumsum(vals, dim=1, out=tau[:, 1:])
    tau[:, 1:] += R
    return tau / sps.step_curve(R, n).to(vals.dtype)


def admission(survival: torch.Tensor, sps: SPSTable) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """The Θ curve of a step's admission order and how a count along it becomes lengths.
    survival `[G, R, γ]` → (Θ `[G, n + 1]`, count `[G]` → lengths `[G, R]`).

    Ragged tables (Σ(1 + ℓ) batch tokens): candidates one at a time in survival order
    (n = R·γ, `theta_curve`). Padded tables (the step costs R × (1 + max ℓ) tokens, `SPSTable.padded`):
    admitting one draft beyond the current longest costs as much as a whole level, and drafts below
    it cost nothing, so the order is by level: count L admits position L for every request
    (n = γ; Θ(L) = Σ_r (1 + Σ_{j≤L} a_{r,j}) / t(R, 1 + L)). Both orders are non-anticipating:
    whether (r, k) is admitted depends on survivals up to position k (which see x_{<k} only) of
    candidates that come no later, so a break at the first count where Θ stops rising is lossless."""
    G, R, gamma = survival.shape
    if sps.padded:
        tau = torch.empty(G, gamma + 1, dtype=torch.float64)
        tau[:, 0] = R
        torch.cumsum(survival.to(torch.float64).sum(1), dim=1, out=tau[:, 1:])
        tau[:, 1:] += R
        return tau / sps.level_curve(R, gamma), lambda count: count.clamp(max=gamma)[:, None].expand(G, R).clone()
    vals, req = sorted_candidates(survival)
    return theta_curve(vals, R, sps), lambda count: lengths_from_count(req, count.clamp(max=R * gamma), R)


def plain_theta(R: int, sps: SPSTable) -> float | None:
    """Tokens per second of a step without a draft at R requests (R tokens); None if the table does not say."""
    t = sps.plain_seconds(R)
    return None if t is None else R / t


def lengths_from_count(req: torch.Tensor, count: torch.Tensor, R: int) -> torch.Tensor:
    """Admit the first `count[g]` sorted candidates of each batch. → lengths `[G, R]` long."""
    G, n = req.shape
    admitted = torch.arange(n).unsqueeze(0) < count.unsqueeze(1)  # [G, n]
    return torch.zeros(G, R, dtype=torch.long).scatter_add_(1, req, admitted.long())


def early_stop_count(theta: torch.Tensor) -> torch.Tensor:
    """Algorithm 1's break: number of candidates admitted while Θ strictly rises. `[G, n+1]` → `[G]`."""
    rise = theta[:, 1:] > theta[:, :-1]  # [G, n]
    return torch.cumprod(rise.to(torch.uint8), dim=1).sum(1).long()


def argmax_count(theta: torch.Tensor) -> torch.Tensor:
    """Unrestricted search: the m with the largest Θ (the smallest such m). `[G, n+1]` → `[G]`."""
    best = theta.max(dim=1, keepdim=True).values
    return (theta >= best).to(torch.uint8).argmax(dim=1).long()


def expected_throughput(survival: torch.Tensor, lengths: torch.Tensor, sps: SPSTable) -> torch.Tensor:
    """Θ = τ* / step time of a drafted step with given lengths, in the table's layout (= τ*·SPS(B)
    for a table without a grid). survival `[..., R, γ]`, lengths `[..., R]` → `[...]` float64."""
    gamma = survival.shape[-1]
    mask = torch.arange(gamma) < lengths.unsqueeze(-1)  # [..., R, γ]
    tau = (1.0 + (survival.to(torch.float64) * mask).sum(-1)).sum(-1)
    return tau / sps.lengths_seconds(lengths)
