"""SamplingParams validation, warp_probs (greedy/temperature/top-k/top-p, never NaN), sample."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from dsparkctl.errors import UsageError
from dsparkctl.math.sampling import SamplingParams, sample, warp_probs


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1.0}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"top_k": -1}, {"top_k": 2.5}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.1},
])
def test_bad_params_raise_usage_error(kwargs):
    with pytest.raises(UsageError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.hint


def test_greedy_flag():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.5).greedy


LOGITS = torch.tensor([1.0, 3.0, 3.0, 0.0, -1.0])

# params -> expected probabilities (computed by hand from LOGITS)
def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]

NEG = -math.inf
WARP_CASES = {
    "greedy: first index on ties": (SamplingParams(), [0, 1, 0, 0, 0]),
    "T=1": (SamplingParams(1.0), _softmax([1, 3, 3, 0, -1])),
    "T=2": (SamplingParams(2.0), _softmax([0.5, 1.5, 1.5, 0, -0.5])),
    "top-k 3": (SamplingParams(1.0, top_k=3), _softmax([1, 3, 3, NEG, NEG])),
    "top-k larger than V": (SamplingParams(1.0, top_k=50), _softmax([1, 3, 3, 0, -1])),
    # sorted probs at T=1: .4538 .4538 .0614 .0226 .0083 (mass before each: 0 .454 .908 .969 .992);
    # a token is kept while the mass before it is < top_p
    "top-p 0.5": (SamplingParams(1.0, top_p=0.5), _softmax([NEG, 3, 3, NEG, NEG])),
    "top-p 0.9": (SamplingParams(1.0, top_p=0.9), _softmax([NEG, 3, 3, NEG, NEG])),
    "top-p 0.95": (SamplingParams(1.0, top_p=0.95), _softmax([1, 3, 3, NEG, NEG])),
    "top-p tiny keeps the top token": (SamplingParams(1.0, top_p=1e-6), [0, 1, 0, 0, 0]),
    "top-k 4 then top-p 0.95 (on the top-k renormalised probs)": (
        SamplingParams(1.0, top_k=4, top_p=0.95), _softmax([1, 3, 3, NEG, NEG])),
}


@pytest.mark.parametrize("name", list(WARP_CASES))
def test_warp_probs_table(name):
    params, expected = WARP_CASES[name]
    got = warp_probs(LOGITS, params)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32), atol=1e-5, rtol=0)


def test_warp_probs_batched_shapes_and_bf16():
    logits = torch.randn(2, 3, 7).to(torch.bfloat16)
    for params in (SamplingParams(), SamplingParams(0.8, top_k=3, top_p=0.9)):
        p = warp_probs(logits, params)
        assert p.shape == (2, 3, 7) and p.dtype == torch.float32
        torch.testing.assert_close(p.sum(-1), torch.ones(2, 3))


@pytest.mark.parametrize("row", [
    [NEG] * 4, [float("nan"), 1.0, 2.0, 0.0], [float("inf"), 0.0, 1.0, 2.0], [1e30, -1e30, 0.0, 5.0],
])
def test_warp_probs_never_nan(row):
    for params in (SamplingParams(1.0), SamplingParams(1e-30), SamplingParams(0.5, top_k=2, top_p=0.5)):
        p = warp_probs(torch.tensor([row]), params)
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p.sum(-1), torch.ones(1))


def test_sample_shape_determinism_and_law():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3])
    batch = probs.expand(4, 50_000, 4)
    a = sample(batch, torch.Generator().manual_seed(3))
    b = sample(batch, torch.Generator().manual_seed(3))
    assert a.shape == (4, 50_000) and a.dtype == torch.long and torch.equal(a, b)
    counts = torch.bincount(a.flatten(), minlength=4).double()
    assert counts[1] == 0
    keep = probs > 0
    pval = chisquare(counts[keep].numpy(), (probs[keep].double() * counts.sum()).numpy()).pvalue
    assert pval > 1e-3
