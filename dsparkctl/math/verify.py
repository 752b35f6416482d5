"""Lossless verification of draft blocks (Leviathan et al. 2023), batched with ragged lengths.

Terms (as in vLLM's rejection sampler):
- *verify length* ℓ_r ∈ {0..γ}: how many of request r's γ draft tokens the target scores.
- *accepted*: the longest prefix of the ℓ_r drafts that passes the test below (0..ℓ_r).
- *recovered* token: after the first rejection at slot a, a token drawn from the residual
  norm(max(0, p_a - q_a)); it replaces the rejected draft and the round stops.
- *bonus* token: when all ℓ_r drafts are accepted, a token drawn from the target's distribution
  p at slot ℓ_r (the slot after the last verified draft).
Each round therefore emits `accepted + 1` tokens: the accepted drafts, then exactly one
recovered or bonus token.

Slots: target slot j (0-based) is the target's distribution for draft token j (0-based), i.e.
the target run over [x0, x1..xℓ] produces ℓ+1 distributions; slot ℓ_r is the bonus slot.
Slots after ℓ_r (target) and from ℓ_r on (draft) are ignored and may hold garbage.

Test at slot j (sampling): accept x_j iff u_j · q_j(x_j) < p_j(x_j), u_j ~ U[0,1), which is
acceptance with probability min(1, p/q) without dividing. p(x)=0 always rejects; q(x)=0 < p(x)
always accepts (x could not have been drawn; guarded anyway).
Greedy: accept iff x_j == argmax p_j; the emitted token is argmax p_a (no randomness).

Output law: for ANY draft distribution q the emitted tokens follow the target p exactly
(`tests/test_verify.py` checks this with a chi-square test). Zero-mass corners: if the residual
has zero mass (p == q up to rounding, or both zero at the token), the recovered token is drawn
from p instead; this event has probability 0 under the rule, so exactness is unaffected, and no
NaN can appear anywhere (the categorical draw is an exponential race on unnormalised weights).

`verify` is fully vectorised over requests and slots; `verify_reference` is a plain per-request
loop kept as the oracle; both consume the same explicit random draws via `_verify_with_noise`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsparkctl.math.sampling import exponential_noise, sample_with_noise

__all__ = ["VerifyResult", "verify", "verify_reference", "RESIDUAL_EPS"]

# Residual mass at or below this is treated as zero (recover from p instead).
RESIDUAL_EPS = 1e-9


@dataclass
class VerifyResult:
    accepted: Tensor     # [R] long, drafts accepted per request, 0..ℓ_r
    emitted: Tensor      # [R, γ+1] long, accepted drafts then one recovered/bonus token, -1 padded
    num_emitted: Tensor  # [R] long, accepted + 1


def _check_shapes(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor,
                  verify_lengths: Tensor) -> tuple[int, int, int]:
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [R, γ+1, V], got {tuple(target_probs.shape)}")
    R, g1, V = target_probs.shape
    g = g1 - 1
    if draft_tokens.shape != (R, g):
        raise ValueError(f"draft_tokens must be [R={R}, γ={g}], got {tuple(draft_tokens.shape)}")
    if draft_probs is not None and draft_probs.shape != (R, g, V):
        raise ValueError(f"draft_probs must be [{R}, {g}, {V}], got {tuple(draft_probs.shape)}")
    if verify_lengths.shape != (R,):
        raise ValueError(f"verify_lengths must be [R={R}], got {tuple(verify_lengths.shape)}")
    return R, g, V


def _verify_with_noise(
    target_probs: Tensor,    # [R, γ+1, V] warped target probs
    draft_probs: Tensor,     # [R, γ, V] draft distribution each token was drawn from (unused if greedy)
    draft_tokens: Tensor,    # [R, γ] long
    verify_lengths: Tensor,  # [R] long in 0..γ
    uniforms: Tensor | None, # [R, γ] U[0,1) acceptance draws (None if greedy)
    noise: Tensor | None,    # [R, V] Exp(1) noise for the one recovered/bonus draw (None if greedy)
    greedy: bool,
) -> VerifyResult:
    R, g, V = _check_shapes(target_probs, draft_probs, draft_tokens, verify_lengths)
    device = target_probs.device
    lengths = verify_lengths.to(device=device, dtype=torch.long)
    slots = torch.arange(g, device=device)                                  # [γ]
    valid = slots.unsqueeze(0) < lengths.unsqueeze(1)                       # [R, γ]
    tokens = draft_tokens.to(device=device, dtype=torch.long)
    safe_tokens = torch.where(valid, tokens, torch.zeros_like(tokens)).clamp_(0, V - 1)  # [R, γ]

    p_draft_slots = target_probs[:, :g, :]                                  # [R, γ, V]
    if greedy:
        best = target_probs.argmax(dim=-1)                                  # [R, γ+1] one pass for every slot
        ok = safe_tokens == best[:, :g]                                     # [R, γ]
    else:
        p_x = p_draft_slots.gather(-1, safe_tokens.unsqueeze(-1)).squeeze(-1).float()  # [R, γ]
        q_x = draft_probs.gather(-1, safe_tokens.unsqueeze(-1)).squeeze(-1).float()    # [R, γ]
        ok = uniforms.to(device) * q_x < p_x                                 # [R, γ]
    ok = ok & valid
    accepted = ok.to(torch.long).cumprod(dim=1).sum(dim=1)                  # [R] first-reject count

    rows = torch.arange(R, device=device)
    if greedy:
        final = best[rows, accepted]                                        # [R] argmax at slot a = accepted
    else:
        p_a = target_probs[rows, accepted].float()                          # [R, V] slot a = accepted
        rejected = accepted < lengths                                       # [R] recovered vs bonus
        q_a = draft_probs[rows, accepted.clamp(max=max(g - 1, 0))].float() if g > 0 else p_a
        residual = (p_a - q_a).clamp_min_(0.0)                              # [R, V]
        use_residual = rejected & (residual.sum(dim=-1) > RESIDUAL_EPS)     # [R]
        weights = torch.where(use_residual.unsqueeze(-1), residual, p_a)    # [R, V]
        final = sample_with_noise(weights, noise.to(device))                # [R]

    cols = torch.arange(g + 1, device=device)                               # [γ+1]
    padded = torch.cat([tokens, tokens.new_full((R, 1), -1)], dim=1)        # [R, γ+1]
    emitted = torch.where(cols.unsqueeze(0) < accepted.unsqueeze(1), padded, torch.full_like(padded, -1))
    emitted.scatter_(1, accepted.unsqueeze(1), final.unsqueeze(1))
    return VerifyResult(accepted=accepted, emitted=emitted, num_emitted=accepted + 1)


def _draw_noise(R: int, g: int, V: int, generator, device) -> tuple[Tensor, Tensor]:
    uniforms = torch.rand((R, g), generator=generator, device=device)      # [R, γ]
    noise = exponential_noise((R, V), generator, device)                    # [R, V]
    return uniforms, noise


def verify(
    target_probs: Tensor,    # [R, γ+1, V] warped target probs, slot j scores draft j, slot ℓ_r = bonus
    draft_probs: Tensor,     # [R, γ, V] warped draft distributions the draft tokens were sampled from
    draft_tokens: Tensor,    # [R, γ] long
    verify_lengths: Tensor,  # [R] long, ℓ_r in 0..γ
    generator: torch.Generator | None,
    greedy: bool,
) -> VerifyResult:
    """Accept a prefix of each request's drafts and emit one more token; exact for any draft.

    Vectorised: one comparison per slot for all requests, first rejection by a cumulative
    product, and a single categorical draw per request (residual at the first rejected slot, or
    p at the bonus slot). Greedy needs no generator and ignores `draft_probs`.
    """
    if greedy and target_probs.dim() == 3 and target_probs.shape[0] == 1:
        return _verify_greedy_one(target_probs, draft_tokens, verify_lengths)
    if greedy:
        return _verify_with_noise(target_probs, draft_probs, draft_tokens, verify_lengths, None, None, True)
    R, g, V = _check_shapes(target_probs, draft_probs, draft_tokens, verify_lengths)
    uniforms, noise = _draw_noise(R, g, V, generator, target_probs.device)
    return _verify_with_noise(target_probs, draft_probs, draft_tokens, verify_lengths, uniforms, noise, False)


def _verify_greedy_one(target_probs: Tensor, draft_tokens: Tensor, verify_lengths: Tensor) -> VerifyResult:
    """Greedy `verify` of one request (a user's batch 1): one argmax, then the comparison on
    Python lists, instead of the vectorised form's two dozen small tensor ops. Same result."""
    _, g, _ = _check_shapes(target_probs, None, draft_tokens, verify_lengths)
    ell = min(max(int(verify_lengths[0]), 0), g)  # as the vectorised form reads it
    best = target_probs[0, : ell + 1].argmax(dim=-1).tolist()
    drafts = draft_tokens[0, :ell].tolist()
    a = 0
    while a < ell and drafts[a] == best[a]:
        a += 1
    dev = target_probs.device
    return VerifyResult(accepted=torch.tensor([a], device=dev),
                        emitted=torch.tensor([drafts[:a] + [best[a]] + [-1] * (g - a)], device=dev),
                        num_emitted=torch.tensor([a + 1], device=dev))


def _reference_with_noise(target_probs, draft_probs, draft_tokens, verify_lengths,
                          uniforms, noise, greedy: bool) -> VerifyResult:
    """Plain loop over requests and slots; the oracle for `_verify_with_noise`."""
    R, g, V = _check_shapes(target_probs, draft_probs, draft_tokens, verify_lengths)
    accepted = torch.zeros(R, dtype=torch.long)
    emitted = torch.full((R, g + 1), -1, dtype=torch.long)
    for r in range(R):
        ell = int(verify_lengths[r])
        out: list[int] = []
        token = None
        for j in range(ell):
            x = int(draft_tokens[r, j])
            p = target_probs[r, j].float()
            if greedy:
                if x == int(p.argmax()):
                    out.append(x)
                    continue
                token = int(p.argmax())
                break
            q = draft_probs[r, j].float()
            if float(uniforms[r, j]) * float(q[x]) < float(p[x]):
                out.append(x)
                continue
            residual = (p - q).clamp_min(0.0)
            weights = residual if float(residual.sum()) > RESIDUAL_EPS else p
            token = int(sample_with_noise(weights, noise[r]))
            break
        if token is None:  # all ℓ accepted: bonus from slot ℓ
            p = target_probs[r, ell].float()
            token = int(p.argmax()) if greedy else int(sample_with_noise(p, noise[r]))
        accepted[r] = len(out)
        emitted[r, : len(out) + 1] = torch.tensor(out + [token])
    return VerifyResult(accepted=accepted, emitted=emitted, num_emitted=accepted + 1)


def verify_reference(target_probs, draft_probs, draft_tokens, verify_lengths,
                     generator: torch.Generator | None, greedy: bool) -> VerifyResult:
    """Same contract and same random draws as `verify` (given an identically seeded generator)."""
    if greedy:
        return _reference_with_noise(target_probs, draft_probs, draft_tokens, verify_lengths, None, None, True)
    R, g, V = _check_shapes(target_probs, draft_probs, draft_tokens, verify_lengths)
    uniforms, noise = _draw_noise(R, g, V, generator, target_probs.device)
    return _reference_with_noise(target_probs.cpu(), draft_probs.cpu(), draft_tokens.cpu(),
                                 verify_lengths.cpu(), uniforms.cpu(), noise.cpu(), False)
