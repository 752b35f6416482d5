"""Sampling parameters, logit warping and categorical sampling.

Terms:
- *warped* distribution: the probabilities a token is actually drawn from after temperature,
  top-k and top-p are applied to raw logits. Both the target and the draft are compared through
  their warped distributions (the acceptance rule is exact for any draft distribution, so warping
  the draft only changes the acceptance rate, never the output law).
- *greedy* (temperature 0): the warped distribution is a one-hot vector on the argmax (the first
  index on ties, which is what `torch.argmax` returns).

Randomness is always passed in as a `torch.Generator`; nothing here touches the global RNG unless
the caller passes `generator=None`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dsparkctl.errors import UsageError, option

__all__ = ["SamplingParams", "warp_probs", "sample", "draw", "exponential_noise", "sample_with_noise"]


@dataclass(frozen=True)
class SamplingParams:
    """How target and draft tokens are drawn.

    temperature: 0 means greedy; otherwise logits are divided by it. Must be finite and >= 0.
    top_k: keep the k largest logits (0 = off).
    top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = off); in (0, 1].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise UsageError(
                f"{option('temperature')} must be a finite number >= 0, got {t!r}",
                hint="use 0 for greedy decoding or a positive value such as 1.0",
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UsageError(
                f"{option('top_k')} must be an integer >= 0, got {self.top_k!r}",
                hint="use 0 to disable top-k",
            )
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0.0 < p <= 1.0):
            raise UsageError(
                f"{option('top_p')} must be in (0, 1], got {p!r}",
                hint="use 1.0 to disable top-p",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _one_hot_argmax(logits: Tensor) -> Tensor:
    # logits: [..., V] -> float32 one-hot on the first maximal index.
    out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return out


def warp_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Turn raw logits into the warped sampling distribution.

    logits: [..., V] any float dtype.  Returns float32 probabilities [..., V] that sum to 1.
    Order: greedy short-circuit -> temperature -> top-k -> top-p -> softmax.
    Never returns NaN: a row whose softmax is undefined (all -inf, +inf or NaN logits, or an
    overflow from a tiny temperature) falls back to the one-hot argmax of the raw logits.
    """
    if params.greedy:
        return _one_hot_argmax(logits)
    x = logits.float()
    if params.temperature != 1.0:
        x = x / params.temperature
    vocab = x.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k or params.top_p < 1.0:
        # Candidates in descending order: the k largest (exactly k, ties broken by topk) or all.
        if top_k:
            cand, order = torch.topk(x, top_k, dim=-1)              # [..., k]
        else:
            cand, order = torch.sort(x, dim=-1, descending=True)    # [..., V]
        if params.top_p < 1.0:
            cand_p = torch.softmax(cand, dim=-1)
            # mass strictly before each candidate (on the top-k renormalised distribution); a
            # candidate is dropped once that mass reaches top_p, so the first is always kept.
            before = torch.cumsum(cand_p, dim=-1) - cand_p
            cand = cand.masked_fill(before >= params.top_p, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter_(-1, order, cand)
    probs = torch.softmax(x, dim=-1)
    bad = ~torch.isfinite(probs).all(dim=-1, keepdim=True)  # [..., 1]
    # On CPU a check is free; on accelerators `bool(...)` would sync the device on the hot path,
    # so the fallback is applied unconditionally there.
    if probs.device.type != "cpu" or bool(bad.any()):
        probs = torch.where(bad, _one_hot_argmax(torch.nan_to_num(logits.float(), nan=-math.inf)), probs)
    return probs


def exponential_noise(shape, generator: torch.Generator | None, device=None) -> Tensor:
    """Exp(1) noise [shape] (float32) for the exponential-race sampler, clamped away from 0."""
    # -log(U) with U ~ U(0, 1]; several times faster than Tensor.exponential_ on CPU.
    u = torch.rand(shape, dtype=torch.float32, device=device, generator=generator)
    return torch.log1p_(u.neg_()).neg_().clamp_min_(torch.finfo(torch.float32).tiny)


def sample_with_noise(weights: Tensor, noise: Tensor) -> Tensor:
    """Categorical draw by exponential race: argmax_i w_i / E_i with E_i ~ Exp(1) iid.

    weights: [..., V] non-negative, need not be normalised; noise: [..., V] Exp(1).
    Returns LongTensor [...]. Index i wins with probability w_i / sum(w). Zero weights never win
    unless the whole row is zero (then index 0).
    """
    return (weights.float() / noise).argmax(dim=-1)


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """Draw one token per row. probs: [..., V] (rows need not be normalised) -> LongTensor [...]."""
    return sample_with_noise(probs, exponential_noise(probs.shape, generator, probs.device))


def draw(scores: Tensor, params: SamplingParams, generator: torch.Generator | None, *,
         warped: bool = False) -> Tensor:
    """The next token per row: the argmax when greedy, else a sample of the warped distribution.

    scores: [..., V] raw logits, or probabilities already warped (`warped=True`). Returns [...]."""
    if params.greedy:
        return scores.argmax(dim=-1)
    return sample(scores if warped else warp_probs(scores, params), generator)
