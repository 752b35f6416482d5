"""Acceptance statistics: hand-computed metrics, merge, JSON round trip, Wilson intervals."""

from __future__ import annotations

import json
import random

import pytest
import torch
from scipy.stats import binomtest

from dsparkctl.math.stats import AcceptanceStats, wilson_interval

# γ = 3; rounds as (verify_length, accepted) with what each contributes:
ROUNDS = [
    (3, 3),  # positions 1,2,3 reached and accepted (+ bonus) -> 4 tokens
    (3, 0),  # position 1 reached, rejected                 -> 1 token
    (2, 1),  # 1 accepted, 2 reached and rejected           -> 2 tokens
    (0, 0),  # nothing verified, bonus only                 -> 1 token
    (3, 1),  # 1 accepted, 2 reached and rejected; 3 never  -> 2 tokens
]


def _stats(rounds=ROUNDS, g=3):
    s = AcceptanceStats(block_size=g)
    s.add_rounds([r[0] for r in rounds], [r[1] for r in rounds])
    return s


def test_hand_computed_metrics():
    s = _stats()
    assert (s.rounds, s.tokens, s.verified) == (5, 10, 11)
    assert s.tau == 2.0
    assert s.histogram == [2, 2, 0, 1]
    assert s.reached == [4, 3, 1]
    assert s.accepted_at == [3, 1, 1]
    assert s.conditional() == pytest.approx([3 / 4, 1 / 3, 1.0])
    assert s.survival() == pytest.approx([0.75, 0.25, 0.25])
    # vLLM's draft acceptance rate: 5 accepted of 11 verified drafts; DeepSpec's verify_rate:
    # 10 emitted tokens for 11 drafts + 5 bonus slots scored
    assert s.draft_acceptance_rate == pytest.approx(5 / 11)
    assert s.verify_rate == pytest.approx(10 / 16)
    assert AcceptanceStats(block_size=3).draft_acceptance_rate is None


def test_tensor_input_and_empty():
    s = AcceptanceStats(block_size=3)
    s.add_rounds(torch.tensor([r[0] for r in ROUNDS]), torch.tensor([r[1] for r in ROUNDS]))
    assert s == _stats()
    e = AcceptanceStats(block_size=4)
    assert e.tau is None and e.conditional() == [None] * 4 and e.survival() == [None] * 4
    assert e.survival_interval() == [None] * 4


def test_undefined_and_zero_survival():
    s = _stats([(3, 0), (3, 0)])
    assert s.conditional() == [0.0, None, None]
    assert s.survival() == [0.0, 0.0, 0.0]  # zero stays zero even though c_2 is undefined
    s = _stats([(1, 1), (1, 1)])
    assert s.conditional() == [1.0, None, None]
    assert s.survival() == [1.0, None, None]


@pytest.mark.parametrize("bad", [([2], [3]), ([4], [0]), ([1], [-1]), ([1, 2], [0])])
def test_rejects_inconsistent_rounds(bad):
    with pytest.raises(ValueError):
        AcceptanceStats(block_size=3).add_rounds(*bad)


def _random_rounds(n, g, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ell = rng.randint(0, g)
        out.append((ell, rng.randint(0, ell)))
    return out


def test_merge_equals_combined():
    a_rounds, b_rounds = _random_rounds(100, 5, 1), _random_rounds(37, 5, 2)
    merged = _stats(a_rounds, 5).merge(_stats(b_rounds, 5))
    assert merged == _stats(a_rounds + b_rounds, 5)
    # adding in several calls == one call
    s = AcceptanceStats(block_size=5)
    for r in a_rounds + b_rounds:
        s.add_rounds([r[0]], [r[1]])
    assert s == merged
    with pytest.raises(ValueError):
        merged.merge(AcceptanceStats(block_size=4))


def test_json_round_trip():
    s = _stats(_random_rounds(50, 7, 3), 7)
    d = json.loads(json.dumps(s.to_json()))
    assert AcceptanceStats.from_json(d) == s
    assert d["tau"] == s.tau and d["survival"] == s.survival()
    with pytest.raises(ValueError):
        AcceptanceStats.from_json({**d, "histogram": [0] * 8})
    with pytest.raises(ValueError):
        AcceptanceStats.from_json({"block_size": 3})


@pytest.mark.parametrize("k,n,lo,hi", [
    (5, 10, 0.2366, 0.7634),   # textbook values
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (1, 20, 0.0089, 0.2361),
])
def test_wilson_known_values(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)


@pytest.mark.parametrize("k,n", [(0, 1), (3, 7), (81, 263), (999, 1000), (50, 50)])
def test_wilson_matches_scipy(k, n):
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson_interval(k, n, z=1.959963984540054) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_wilson_no_trials():
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_survival_interval_under_full_verification_is_plain_wilson():
    g = 4
    rng = random.Random(5)
    rounds = [(g, min(g, int(rng.expovariate(0.5)))) for _ in range(300)]
    s = _stats(rounds, g)
    for j, ci in enumerate(s.survival_interval(), start=1):
        k = sum(1 for _, a in rounds if a >= j)
        assert s.survival()[j - 1] == pytest.approx(k / len(rounds))
        assert ci == pytest.approx(wilson_interval(k, len(rounds)), abs=1e-9)


def test_intervals_contain_estimates_under_ragged_verification():
    s = _stats(_random_rounds(400, 5, 7), 5)
    for est, ci in zip(s.conditional(), s.conditional_interval()):
        assert ci[0] <= est <= ci[1]
    for est, ci in zip(s.survival(), s.survival_interval()):
        assert ci[0] <= est <= ci[1]


def test_intervals_over_prompts_resample_prompts_not_rounds():
    """Rounds of one prompt move together: eight prompts whose c_1 is 0 or 1 each (all rounds alike)
    give a wide interval over prompts, where Wilson over their 400 rounds would be narrow. With
    fewer than eight prompts the report falls back to Wilson and says its unit is the round."""
    from dsparkctl.math.stats import acceptance_intervals, prompt_intervals

    units = []
    for i in range(8):
        u = AcceptanceStats(block_size=2)
        u.add_rounds([2] * 50, [2 if i % 2 else 0] * 50)
        units.append(u)
    pooled = units[0]
    for u in units[1:]:
        pooled = pooled.merge(u)
    boot = prompt_intervals(units)
    lo, hi = boot["conditional"][0]
    wl, wh = pooled.conditional_interval()[0]
    assert boot["unit"] == "prompt" and boot["units"] == 8
    assert lo < 0.3 and hi > 0.7 and wh - wl < 0.1  # the prompt is the unit: the spread of 8, not of 400
    got = acceptance_intervals(pooled, units)
    assert got["interval_unit"] == "prompt" and got["conditional_interval"][0] == (lo, hi)
    few = acceptance_intervals(pooled, units[:7])
    assert few["interval_unit"] == "round" and few["conditional_interval"][0] == (wl, wh)
    # a position few rounds reached is never narrower than Wilson (0 of 2 resamples to 0 every time)
    rare = [AcceptanceStats(block_size=2) for _ in range(8)]
    for k, u in enumerate(rare):
        u.add_rounds([2] * 10, [1 if k else 0] + [0] * 9)  # position 2 reached once, rejected
    both = rare[0]
    for u in rare[1:]:
        both = both.merge(u)
    assert acceptance_intervals(both, rare)["conditional_interval"][1][1] >= both.conditional_interval()[1][1]
