"""Lossless verification: hand cases, vectorised == reference oracle, and exactness in law."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dsparkctl.math.sampling import SamplingParams, exponential_noise, sample, sample_with_noise, warp_probs
from dsparkctl.math.verify import _reference_with_noise, _verify_with_noise, verify, verify_reference

V = 6
NAN = float("nan")


def onehot(i: int) -> list[float]:
    return [1.0 if k == i else 0.0 for k in range(V)]


UNIFORM = [1.0 / V] * V
GARBAGE = [NAN] * V

# Each case: target slots (γ+1 = 4 rows), draft slots (γ = 3), draft tokens, ℓ, greedy,
# expected accepted, expected emitted (γ+1, -1 padded). Slots beyond ℓ hold garbage on purpose.
CASES = {
    "all accepted + bonus": (
        [onehot(1), onehot(2), onehot(3), onehot(4)], [UNIFORM, UNIFORM, UNIFORM], [1, 2, 3], 3, False,
        3, [1, 2, 3, 4]),
    "first rejected -> residual": (
        [onehot(2), GARBAGE, GARBAGE, GARBAGE], [onehot(1), GARBAGE, GARBAGE], [1, -1, 99], 3, False,
        0, [2, -1, -1, -1]),
    "second rejected": (
        [onehot(1), onehot(5), GARBAGE, GARBAGE], [onehot(1), onehot(0), GARBAGE], [1, 0, -7], 3, False,
        1, [1, 5, -1, -1]),
    "ell=0 -> bonus only": (
        [onehot(3), GARBAGE, GARBAGE, GARBAGE], [GARBAGE, GARBAGE, GARBAGE], [-1, -1, -1], 0, False,
        0, [3, -1, -1, -1]),
    "ell=2 all accepted -> bonus at slot 2": (
        [onehot(0), onehot(0), onehot(5), GARBAGE], [onehot(0), UNIFORM, GARBAGE], [0, 0, 4], 2, False,
        2, [0, 0, 5, -1]),
    "greedy exact match then correction": (
        [onehot(1), onehot(2), onehot(3), onehot(4)], [GARBAGE, GARBAGE, GARBAGE], [1, 2, 0], 3, True,
        2, [1, 2, 3, -1]),
    "greedy all match -> bonus argmax": (
        [onehot(1), onehot(2), onehot(3), onehot(4)], [GARBAGE, GARBAGE, GARBAGE], [1, 2, 3], 3, True,
        3, [1, 2, 3, 4]),
    "greedy ell=1 mismatch": (
        [onehot(1), GARBAGE, GARBAGE, GARBAGE], [GARBAGE, GARBAGE, GARBAGE], [0, 2, 3], 1, True,
        0, [1, -1, -1, -1]),
    "q(x)=0 < p(x): accepted": (
        [onehot(2), onehot(4), GARBAGE, GARBAGE], [onehot(0), GARBAGE, GARBAGE], [2, 0, 0], 1, False,
        1, [2, 4, -1, -1]),
    "p(x)=q(x)=0 and p==q: reject, residual empty -> from p": (
        [onehot(3), GARBAGE, GARBAGE, GARBAGE], [onehot(3), GARBAGE, GARBAGE], [0, 0, 0], 2, False,
        0, [3, -1, -1, -1]),
}


def _batch(names):
    rows = [CASES[n] for n in names]
    tp = torch.tensor([r[0] for r in rows])
    dp = torch.tensor([r[1] for r in rows])
    tok = torch.tensor([r[2] for r in rows])
    ell = torch.tensor([r[3] for r in rows])
    return tp, dp, tok, ell


@pytest.mark.parametrize("name", list(CASES))
def test_hand_case(name):
    *_, greedy, acc, emitted = CASES[name]
    tp, dp, tok, ell = _batch([name])
    for fn in (verify, verify_reference):
        res = fn(tp, dp, tok, ell, torch.Generator().manual_seed(0), greedy)
        assert res.accepted.tolist() == [acc], fn.__name__
        assert res.emitted.tolist() == [emitted], fn.__name__
        assert res.num_emitted.tolist() == [acc + 1]


@pytest.mark.parametrize("greedy", [False, True])
def test_ragged_batch_of_hand_cases(greedy):
    names = [n for n in CASES if CASES[n][4] == greedy]
    tp, dp, tok, ell = _batch(names)
    res = verify(tp, dp, tok, ell, torch.Generator().manual_seed(1), greedy)
    assert res.accepted.tolist() == [CASES[n][5] for n in names]
    assert res.emitted.tolist() == [CASES[n][6] for n in names]


def test_vectorised_equals_reference_on_random_ragged_batches():
    gen = torch.Generator().manual_seed(123)
    R, g, v = 257, 5, 9
    for trial in range(4):
        # sparse-ish distributions so rejections, residuals and zero corners all occur
        tp = torch.softmax(torch.randn(R, g + 1, v, generator=gen) * 3, -1)
        dp = torch.softmax(torch.randn(R, g, v, generator=gen) * 3, -1)
        tp = torch.where(tp < 0.05, torch.zeros_like(tp), tp)
        dp = torch.where(dp < 0.05, torch.zeros_like(dp), dp)
        if trial == 1:
            dp = tp[:, :g].clone()  # p == q: residual is empty everywhere
        tok = sample(dp, gen)
        ell = torch.randint(0, g + 1, (R,), generator=gen)
        u = torch.rand(R, g, generator=gen)
        noise = exponential_noise((R, v), gen)
        for greedy in (False, True):
            a = _verify_with_noise(tp, dp, tok, ell, u, noise, greedy)
            b = _reference_with_noise(tp, dp, tok, ell, u, noise, greedy)
            assert torch.equal(a.accepted, b.accepted)
            assert torch.equal(a.emitted, b.emitted)
            assert (a.accepted <= ell).all()
            assert (a.emitted >= -1).all() and (a.emitted < v).all()
    # and the public wrappers draw the same randomness from equally seeded generators
    a = verify(tp, dp, tok, ell, torch.Generator().manual_seed(5), False)
    b = verify_reference(tp, dp, tok, ell, torch.Generator().manual_seed(5), False)
    assert torch.equal(a.emitted, b.emitted)


def test_empty_block_and_empty_batch():
    tp = torch.tensor([[onehot(2)]])
    res = verify(tp, torch.zeros(1, 0, V), torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]),
                 torch.Generator().manual_seed(0), False)
    assert res.emitted.tolist() == [[2]]
    res = verify(torch.zeros(0, 4, V), torch.zeros(0, 3, V), torch.zeros(0, 3, dtype=torch.long),
                 torch.zeros(0, dtype=torch.long), torch.Generator(), False)
    assert res.emitted.shape == (0, 4)


# --------------------------------------------------------------------------------------------
# Exactness in law. A tiny "language": target P[pos, last] and draft Q[pos, last] depend on the
# position and the previous token (last = V_S means "no previous token"), so both the accept
# test and the prefix-dependence of the residual are exercised. We run one round (ragged ℓ),
# and a second round for rows that emitted only one token, then compare the first emitted token
# and the joint of the first two with the exact target law P[0,·](t1) P[1,t1](t2).
# --------------------------------------------------------------------------------------------
V_S, G_S, R_S = 5, 3, 200_000


def _wrong_verify(rule: str):
    """Deliberately broken rules, vectorised like the real one (used only to show the test bites)."""

    def fn(tp, dp, tok, ell, gen, greedy):
        R, g1, v = tp.shape
        g = g1 - 1
        valid = torch.arange(g) < ell[:, None]
        safe = torch.where(valid, tok, 0)
        p_x = tp[:, :g].gather(-1, safe[..., None])[..., 0]
        q_x = dp.gather(-1, safe[..., None])[..., 0]
        u = torch.rand(R, g, generator=gen)
        ok = (u * p_x < q_x) if rule == "accept_q_over_p" else (u * q_x < p_x)
        acc = (ok & valid).long().cumprod(1).sum(1)
        rows = torch.arange(R)
        p_a = tp[rows, acc]
        q_a = dp[rows, acc.clamp(max=g - 1)]
        rej = acc < ell
        if rule == "recover_from_p":
            w = p_a
        elif rule == "unnormalised_residual":  # residual mixed with p instead of renormalised
            w = torch.where(rej[:, None], (p_a - q_a).clamp_min(0) + p_a * (1 - (p_a - q_a).clamp_min(0).sum(-1, keepdim=True)), p_a)
        else:
            w = torch.where(rej[:, None], (p_a - q_a).clamp_min(0), p_a)
        final = sample_with_noise(w, exponential_noise((R, v), gen))
        emitted = torch.where(torch.arange(g + 1) < acc[:, None], torch.cat([tok, tok[:, :1]], 1), -1)
        emitted.scatter_(1, acc[:, None], final[:, None])

        class Res:
            pass

        r = Res()
        r.accepted, r.emitted, r.num_emitted = acc, emitted, acc + 1
        return r

    return fn


def _tables(seed: int, target_params: SamplingParams, draft_params: SamplingParams):
    gen = torch.Generator().manual_seed(seed)
    logits_p = torch.randn(G_S + 2, V_S + 1, V_S, generator=gen) * 1.5
    logits_q = torch.randn(G_S + 2, V_S + 1, V_S, generator=gen) * 1.5
    return warp_probs(logits_p, target_params), warp_probs(logits_q, draft_params)


def _one_round(P, Q, pos0, last, ell, verify_fn, gen):
    """Draft γ tokens from Q along the row's own prefix, score them with P, verify."""
    R = last.shape[0]
    tokens = torch.empty(R, G_S, dtype=torch.long)
    dprobs = torch.empty(R, G_S, V_S)
    tprobs = torch.empty(R, G_S + 1, V_S)
    prev = last
    for j in range(G_S):
        tprobs[:, j] = P[pos0 + j, prev]
        dprobs[:, j] = Q[pos0 + j, prev]
        prev = sample(dprobs[:, j], gen)
        tokens[:, j] = prev
    tprobs[:, G_S] = P[pos0 + G_S, prev]
    return verify_fn(tprobs, dprobs, tokens, ell, gen, False)


def _first_two_tokens(P, Q, verify_fn, seed):
    gen = torch.Generator().manual_seed(seed)
    ell = torch.randint(0, G_S + 1, (R_S,), generator=gen)  # ragged, independent of the drafts
    start = torch.full((R_S,), V_S, dtype=torch.long)
    r1 = _one_round(P, Q, 0, start, ell, verify_fn, gen)
    t1 = r1.emitted[:, 0]
    ell2 = torch.randint(0, G_S + 1, (R_S,), generator=gen)
    r2 = _one_round(P, Q, 1, t1, ell2, verify_fn, gen)  # used only where round 1 emitted 1 token
    t2 = torch.where(r1.num_emitted >= 2, r1.emitted[:, 1], r2.emitted[:, 0])
    return t1, t2


def _chi2_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    obs = observed.double().flatten()
    exp = expected_probs.double().flatten() * obs.sum()
    support = exp > 0
    if obs[~support].sum() > 0:  # a token the target can never emit was emitted
        return 0.0
    obs, exp = obs[support], exp[support]
    if obs.numel() == 1:  # a single possible outcome, and every draw hit it
        return 1.0
    exp = exp * (obs.sum() / exp.sum())
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def _pvalues(P, Q, verify_fn, seed=7):
    t1, t2 = _first_two_tokens(P, Q, verify_fn, seed)
    first = torch.bincount(t1, minlength=V_S)
    joint = torch.bincount(t1 * V_S + t2, minlength=V_S * V_S).view(V_S, V_S)
    p_first = P[0, V_S]
    p_joint = p_first[:, None] * P[1, :V_S]
    return _chi2_pvalue(first, p_first), _chi2_pvalue(joint, p_joint)


WARPS = {
    "T=1 both": (SamplingParams(1.0), SamplingParams(1.0)),
    "target T=0.7 top-k 3, draft T=1.3": (SamplingParams(0.7, top_k=3), SamplingParams(1.3)),
    "target top-p 0.8, draft top-k 2 (q misses p's support)": (SamplingParams(1.0, top_p=0.8),
                                                                SamplingParams(1.0, top_k=2)),
}


@pytest.mark.parametrize("warp", list(WARPS))
def test_output_law_equals_target(warp):
    P, Q = _tables(11, *WARPS[warp])
    p1, p12 = _pvalues(P, Q, verify)
    print(f"[exact rule | {warp}] first token p={p1:.3g}, first two tokens p={p12:.3g}")
    assert p1 > 1e-3 and p12 > 1e-3


@pytest.mark.parametrize("rule", ["accept_q_over_p", "recover_from_p", "unnormalised_residual"])
def test_wrong_rules_fail_the_same_test(rule):
    P, Q = _tables(11, *WARPS["T=1 both"])
    p1, p12 = _pvalues(P, Q, _wrong_verify(rule))
    print(f"[wrong rule {rule}] first token p={p1:.3g}, first two tokens p={p12:.3g}")
    assert min(p1, p12) < 1e-6


def test_control_rule_in_test_harness_is_exact():
    """The harness's own implementation with the correct rule passes (so failures above are the rule's)."""
    P, Q = _tables(11, *WARPS["T=1 both"])
    p1, p12 = _pvalues(P, Q, _wrong_verify("exact"))
    assert p1 > 1e-3 and p12 > 1e-3


def test_greedy_single_request_path_matches_the_vectorised_one():
    """`verify` takes one greedy request through a list-based path; it must give exactly what the
    vectorised form gives, for every ℓ, with ties in the target's rows and drafts that match."""
    gen = torch.Generator().manual_seed(11)
    g, v = 5, 7
    for trial in range(300):
        tp = torch.randint(0, 3, (1, g + 1, v), generator=gen).float()  # ties are common
        best = tp.argmax(dim=-1)[0]
        tok = torch.randint(0, v, (1, g), generator=gen)
        agree = torch.rand(g, generator=gen) < 0.6
        tok[0] = torch.where(agree, best[:g], tok[0])  # long accepted prefixes too
        ell = torch.tensor([trial % (g + 1)])
        fast = verify(tp, None, tok, ell, None, True)
        ref = _verify_with_noise(tp, None, tok, ell, None, None, True)
        assert torch.equal(fast.accepted, ref.accepted)
        assert torch.equal(fast.emitted, ref.emitted)
        assert torch.equal(fast.num_emitted, ref.num_emitted)
