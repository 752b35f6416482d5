"""Losslessness audit: Appendix A reproduced, lossless policies pass randomised settings,
the retrospective (look-ahead) scheduler fails."""

import pytest
import torch

from dsparkctl.math.audit import appendix_a, audit_policy, chi_square, random_setting
from dsparkctl.math.policy_spec import parse_policy

LOSSLESS = ["dspark", "dspark-async", "static:1", "static:2", "threshold:0.6", "survival:0.3", "budget:2"]


@pytest.mark.parametrize("spec", LOSSLESS + ["retrospective"])
def test_appendix_a(spec):
    s = appendix_a()
    r = audit_policy(s, parse_policy(spec, sps=s.sps), 200_000, torch.Generator().manual_seed(1))
    lo, hi = r.p_token0_ci
    if spec == "retrospective":
        assert abs(r.p_token0 - 0.85) < 0.005 and lo > 0.7
        assert not r.passed and r.first_p < 1e-6
    else:
        assert abs(r.p_token0 - 0.7) < 0.004 and hi - lo < 0.005  # P(A) = 0.7 within 4 s.e. (s.e. 0.001)
        assert r.passed, r.to_json()


def test_appendix_a_schedules():
    # dspark stops at Θ1 = 0.9 < Θ0 = 1.0: never verifies; retrospective verifies only when x1 = A
    s = appendix_a()
    assert audit_policy(s, parse_policy("dspark", sps=s.sps), 20_000,
                        torch.Generator().manual_seed(0)).mean_verify == 0.0
    r = audit_policy(s, parse_policy("retrospective", sps=s.sps), 20_000, torch.Generator().manual_seed(0))
    assert 0.95 < r.mean_verify < 1.05  # 2 drafts half the time


@pytest.mark.parametrize("seed", range(6))
def test_lossless_policies_pass_random_settings(seed):
    s = random_setting(torch.Generator().manual_seed(1000 + seed))
    for spec in LOSSLESS:
        r = audit_policy(s, parse_policy(spec, sps=s.sps), 40_000, torch.Generator().manual_seed(seed))
        assert r.passed, (s.name, r.to_json())


def test_chi_square_reference_values():
    stat, p, dof = chi_square(torch.tensor([50, 50]), torch.tensor([0.5, 0.5]))
    assert (stat, p, dof) == (0.0, 1.0, 1)
    stat, p, dof = chi_square(torch.tensor([60, 40]), torch.tensor([0.5, 0.5]))
    assert stat == pytest.approx(4.0) and p == pytest.approx(0.0455003, rel=1e-5)  # scipy chi2.sf(4, 1)
    assert chi_square(torch.tensor([1, 9]), torch.tensor([0.0, 1.0]))[1] == 0.0


@pytest.mark.parametrize("seed", range(3))
def test_skip_the_draft_path_is_lossless(seed):
    """With a plain-step price the gated policies skip the draft on some steps (from earlier
    steps only) and probe on others; the output law must stay the target's."""
    from dsparkctl.math.audit import with_plain_step

    for s in (with_plain_step(appendix_a(), seed), with_plain_step(random_setting(torch.Generator().manual_seed(2000 + seed)), seed)):
        for spec in ("dspark", "dspark-async", "static:0"):
            r = audit_policy(s, parse_policy(spec, sps=s.sps), 12_000, torch.Generator().manual_seed(seed))
            assert r.passed, (s.name, r.to_json())
            if spec == "static:0":
                assert r.drafted_share == 0.0 and r.mean_verify == 0.0
        r = audit_policy(s, parse_policy("dspark-async", sps=s.sps), 12_000, torch.Generator().manual_seed(seed))
        assert 0.0 < r.drafted_share < 1.0, (s.name, r.drafted_share)  # both paths ran


def test_retrospective_still_fails_with_a_plain_step():
    from dsparkctl.math.audit import with_plain_step

    s = with_plain_step(appendix_a())
    r = audit_policy(s, parse_policy("retrospective", sps=s.sps), 20_000, torch.Generator().manual_seed(0))
    assert not r.passed
