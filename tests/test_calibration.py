"""Calibration metrics, trace labels and STS on synthetic over-confident traces."""

import math

import pytest
import torch

from dsparkctl.math.calibration import CalibrationData, auroc, brier, ece, fit_sts, labels_from_rounds, position_metrics
from dsparkctl.math.synthetic import SyntheticModel, sample_rounds


@pytest.mark.parametrize("ell,acc,cond,surv,succ", [
    # γ = 4; k is a conditional trial when k ≤ ℓ and k ≤ a+1; survival trial when k ≤ ℓ
    (4, 4, [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]),
    (4, 1, [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]),
    (2, 2, [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]),
    (3, 0, [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]),
    (0, 0, [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]),
])
def test_labels(ell, acc, cond, surv, succ):
    lab = labels_from_rounds(torch.tensor([ell]), torch.tensor([acc]), 4)
    assert lab["cond_trial"][0].int().tolist() == cond
    assert lab["surv_trial"][0].int().tolist() == surv
    assert lab["success"][0].int().tolist() == succ


def test_ece_known_values():
    pred = torch.tensor([0.1, 0.1, 0.9, 0.9], dtype=torch.float64)
    lab = torch.tensor([0, 0, 1, 1])
    e, d = ece(pred, lab, bins=10)
    assert e == pytest.approx(0.1)
    assert sum(d["count"]) == 4 and d["count"][1] == 2 and d["count"][9] == 2
    assert ece(torch.tensor([1.0, 0.0]), torch.tensor([1, 0]), bins=5)[0] == 0.0  # 1.0 goes in the last bin


@pytest.mark.parametrize("score,label,want", [
    ([0.1, 0.2, 0.3, 0.4], [0, 0, 1, 1], 1.0),
    ([0.4, 0.3, 0.2, 0.1], [0, 0, 1, 1], 0.0),
    ([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1], 0.5),
    ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], 0.75),
])
def test_auroc(score, label, want):
    assert auroc(torch.tensor(score), torch.tensor(label)) == pytest.approx(want)


def test_auroc_one_class_is_nan_and_brier():
    assert math.isnan(auroc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))
    assert brier(torch.tensor([1.0, 0.0]), torch.tensor([0, 0])) == pytest.approx(0.5)


def _data(model, n, seed):
    s = sample_rounds(model, n, torch.Generator().manual_seed(seed))
    return CalibrationData(s["logits"], s["verify_length"], s["accepted"])


@pytest.mark.parametrize("scale", [2.5, (1.8, 2.2, 2.6, 3.0, 3.4)])
def test_sts_fixes_overconfidence(scale):
    scales = (scale,) * 5 if isinstance(scale, float) else scale
    model = SyntheticModel(overconfidence=scales)
    train, held = _data(model, 40_000, 1), _data(model, 40_000, 2)
    temps = fit_sts(train)
    before = position_metrics(held, torch.ones(5))
    after = position_metrics(held, temps)
    for b, a in zip(before, after):
        assert b["ece"] >= 0.05, b
        assert a["ece"] <= 0.015, a
        assert a["brier"] < b["brier"]
    assert bool((temps > 0).all())
    # order preserving: T > 0 is a monotone map, so position 1's ranking (AUROC) is unchanged
    assert after[0]["auroc"] == pytest.approx(before[0]["auroc"], abs=1e-12)
    # the fit recovers the generating scales roughly
    assert torch.allclose(temps, torch.tensor(scales, dtype=torch.float64), rtol=0.2)


def test_sts_with_partial_verification_uses_only_verified_positions():
    model = SyntheticModel()
    s = sample_rounds(model, 5000, torch.Generator().manual_seed(3), verify_length=2)
    d = CalibrationData(s["logits"], s["verify_length"], s["accepted"])
    temps = fit_sts(d)
    assert temps[2:].tolist() == [1.0, 1.0, 1.0]  # no trials beyond ℓ = 2
    m = position_metrics(d, temps)
    assert [x["n"] for x in m] == [5000, 5000, 0, 0, 0]
