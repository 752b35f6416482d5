"""Confidence calibration: labels from traces, ECE / AUROC / Brier, Sequential Temperature Scaling.

Labels (one round of one request, verify length ℓ, accepted a):
  conditional  position k is a trial when k ≤ ℓ and k ≤ a + 1; success when k ≤ a.
               Scores `c_k = σ(logit_k / T_k)`.
  survival     position k is a trial when k ≤ ℓ (the label "first k accepted" is then known);
               success when k ≤ a. Scores `â_k = Π_{i≤k} σ(logit_i / T_i)`.
  Rows past ℓ are left out even when a rejection makes the label knowable: keeping only the
  failures there would bias the labels.

STS (paper §4): for k = 1..γ in order, choose T_k on a log grid minimising the ECE of `â_k`
against the survival label, with T_1..T_{k-1} already fixed. T_k > 0 keeps the order of
`c_k` (a monotone map of the logit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def labels_from_rounds(verify_length: torch.Tensor, accepted: torch.Tensor, gamma: int) -> dict[str, torch.Tensor]:
    """verify_length, accepted `[N]` long → masks and labels `[N, γ]` bool (see module doc)."""
    k = torch.arange(1, gamma + 1).unsqueeze(0)  # [1, γ]
    ell, acc = verify_length.unsqueeze(1), accepted.unsqueeze(1)
    success = k <= acc
    return {"cond_trial": (k <= ell) & (k <= acc + 1), "surv_trial": k <= ell, "success": success}


def _bin_index(pred: np.ndarray, bins: int) -> np.ndarray:
    return np.minimum((pred * bins).astype(np.int64), bins - 1).clip(0)


def ece(pred: torch.Tensor, label: torch.Tensor, bins: int = 20) -> tuple[float, dict[str, list]]:
    """Expected calibration error with equal-width bins on [0, 1]: Σ_b (n_b/N)·|mean pred − frac pos|.

    pred, label `[N]`. Returns (ECE, per-bin {count, mean_pred, frac_pos, lo, hi}); empty bins
    have count 0 and NaN means.
    """
    p = pred.detach().to(torch.float64).numpy()
    y = label.detach().to(torch.float64).numpy()
    idx = _bin_index(p, bins)
    cnt = np.bincount(idx, minlength=bins).astype(np.float64)
    sp = np.bincount(idx, weights=p, minlength=bins)
    sl = np.bincount(idx, weights=y, minlength=bins)
    value = float(np.abs(sp - sl).sum() / max(p.size, 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        mp = np.where(cnt > 0, sp / cnt, np.nan)
        fp = np.where(cnt > 0, sl / cnt, np.nan)
    edges = np.linspace(0, 1, bins + 1)
    return value, {"count": cnt.astype(int).tolist(), "mean_pred": mp.tolist(), "frac_pos": fp.tolist(),
                   "lo": edges[:-1].tolist(), "hi": edges[1:].tolist()}


def ece_grid(pred: torch.Tensor, label: torch.Tensor, bins: int) -> torch.Tensor:
    """ECE of many candidate predictions at once. pred `[C, N]`, label `[N]` → `[C]` float64."""
    C, N = pred.shape
    p = pred.detach().numpy()
    idx = (_bin_index(p, bins) + bins * np.arange(C)[:, None]).ravel()
    y = np.broadcast_to(label.detach().to(pred.dtype).numpy(), (C, N)).ravel()
    sp = np.bincount(idx, weights=p.ravel(), minlength=C * bins)
    sl = np.bincount(idx, weights=y, minlength=C * bins)
    return torch.from_numpy(np.abs(sp - sl).reshape(C, bins).sum(1) / max(N, 1))


def auroc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve (Mann–Whitney U, ties count half). NaN without both classes."""
    s = score.detach().to(torch.float64).numpy()
    y = label.detach().bool().numpy()
    npos, nneg = int(y.sum()), int((~y).sum())
    if npos == 0 or nneg == 0:
        return math.nan
    _, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts).astype(np.float64)
    avg_rank = ends - (counts - 1) / 2.0  # 1-based average rank of each tie group
    ranks = avg_rank[inv.ravel()]
    return float((ranks[y].sum() - npos * (npos + 1) / 2) / (npos * nneg))


def brier(pred: torch.Tensor, label: torch.Tensor) -> float:
    return float(((pred.to(torch.float64) - label.to(torch.float64)) ** 2).mean()) if pred.numel() else math.nan


@dataclass
class CalibrationData:
    """Rounds with confidence logits, as tensors."""

    logits: torch.Tensor  # [N, γ] raw confidence logits
    verify_length: torch.Tensor  # [N] long
    accepted: torch.Tensor  # [N] long

    @property
    def gamma(self) -> int:
        return self.logits.shape[1]

    def subset(self, mask: torch.Tensor) -> "CalibrationData":
        return CalibrationData(self.logits[mask], self.verify_length[mask], self.accepted[mask])


def survival(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """`[N, γ]` logits, `[γ]` temperatures → `[N, γ]` survival estimates."""
    return torch.cumprod(torch.sigmoid(logits.double() / temperatures.double()), dim=1)


def position_metrics(data: CalibrationData, temperatures: torch.Tensor, bins: int = 20) -> list[dict]:
    """Per position: survival ECE/AUROC/Brier (scores â_k) and conditional ECE/AUROC (scores c_k)."""
    lab = labels_from_rounds(data.verify_length, data.accepted, data.gamma)
    a = survival(data.logits, temperatures)
    c = torch.sigmoid(data.logits.double() / temperatures.double())
    out = []
    for k in range(data.gamma):
        m, y = lab["surv_trial"][:, k], lab["success"][:, k]
        e, diagram = ece(a[m, k], y[m], bins)
        mc = lab["cond_trial"][:, k]
        ec, _ = ece(c[mc, k], y[mc], bins)
        out.append({
            "position": k + 1, "n": int(m.sum()), "bins": bins,
            "ece": e, "auroc": auroc(a[m, k], y[m]), "brier": brier(a[m, k], y[m]),
            "mean_pred": float(a[m, k].mean()) if m.any() else math.nan,
            "survival_rate": float(y[m].double().mean()) if m.any() else math.nan,
            "cond_n": int(mc.sum()), "cond_ece": ec, "cond_auroc": auroc(c[mc, k], y[mc]),
            "cond_brier": brier(c[mc, k], y[mc]), "diagram": diagram,
        })
    return out


GRID_CELLS = 1 << 22  # candidate temperatures × trials scored at once (~40 bytes each in `ece_grid`)
MIN_FIT_TRIALS = 50  # a position needs this many trials, with successes and failures both, to be fitted


def fit_sts(data: CalibrationData, bins: int = 20, t_min: float = 0.05, t_max: float = 20.0,
            grid: int = 61, refine: int = 41, report: list[dict] | None = None) -> torch.Tensor:
    """Sequential Temperature Scaling. Returns temperatures `[γ]` float64.

    For each position a log-spaced grid of `grid` points on [t_min, t_max], then a finer grid of
    `refine` points between the best point's neighbours. A position with fewer than
    MIN_FIT_TRIALS trials, or without both outcomes, is not fitted: it keeps T = 1. `report`
    (when given) receives one entry per position: {"position", "trials", "status"} with status
    "fitted", "edge" (the best T is an end of the search grid: no T in range calibrates it, e.g.
    a head whose bias is off, which temperature cannot move) or "too few".
    """
    lab = labels_from_rounds(data.verify_length, data.accepted, data.gamma)
    logits = data.logits.double()
    temps = torch.ones(data.gamma, dtype=torch.float64)
    prefix = torch.ones(logits.shape[0], dtype=torch.float64)  # Π_{i<k} σ(l_i / T_i)
    for k in range(data.gamma):
        m = lab["surv_trial"][:, k]
        n, pos = int(m.sum()), int(lab["success"][m, k].sum())
        status = "too few" if n < MIN_FIT_TRIALS or pos == 0 or pos == n else "fitted"
        if status == "fitted":
            y, pk, lk = lab["success"][m, k], prefix[m].float(), logits[m, k].float()

            def scores(ts: torch.Tensor) -> torch.Tensor:
                best = torch.empty(ts.numel(), dtype=torch.float64)
                step = max(1, min(16, GRID_CELLS // n))  # [step, N] at a time: memory bounded, not ∝ N × 16
                for s in range(0, ts.numel(), step):
                    t = ts[s:s + step].unsqueeze(1).float()
                    best[s:s + step] = ece_grid(pk.unsqueeze(0) * torch.sigmoid(lk.unsqueeze(0) / t), y, bins)
                return best

            ts = torch.logspace(math.log10(t_min), math.log10(t_max), grid, dtype=torch.float64)
            e = scores(ts)
            i = int(torch.argmin(e))
            lo, hi = ts[max(i - 1, 0)], ts[min(i + 1, grid - 1)]
            fine = torch.logspace(math.log10(lo), math.log10(hi), refine, dtype=torch.float64)
            ef = scores(fine)
            temps[k] = fine[int(torch.argmin(ef))] if float(ef.min()) < float(e[i]) else ts[i]
            if i in (0, grid - 1):
                status = "edge"
        if report is not None:
            report.append({"position": k + 1, "trials": n, "successes": pos, "status": status})
        prefix = prefix * torch.sigmoid(logits[:, k] / temps[k])
    return temps


def split_requests(keys: torch.Tensor, holdout: float, gen: torch.Generator) -> torch.Tensor:
    """Held-out mask `[N]` bool choosing whole requests (no leakage between a request's rounds).
    keys `[N]` long request identifiers."""
    uniq, inv = torch.unique(keys, return_inverse=True)
    perm = torch.randperm(uniq.numel(), generator=gen)
    n_hold = int(round(holdout * uniq.numel()))
    if 0 < holdout and n_hold == 0:
        n_hold = 1
    if n_hold >= uniq.numel() and holdout < 1:
        n_hold = uniq.numel() - 1
    is_hold = torch.zeros(uniq.numel(), dtype=torch.bool)
    is_hold[perm[:n_hold]] = True
    return is_hold[inv]
