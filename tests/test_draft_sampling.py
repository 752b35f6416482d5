"""Semi-autoregressive draft sampling: shapes, probs, greedy determinism, dependence on x_{k-1}."""

from __future__ import annotations

import pytest
import torch

from dsparkctl.math.draft_sampling import sample_block
from dsparkctl.math.sampling import SamplingParams, warp_probs
from dsparkctl.models.markov_head import MarkovHead

R, G, V, RANK, H = 4, 5, 17, 3, 8
KINDS = ["vanilla", "gated", "rnn"]
PARAMS = [SamplingParams(), SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)]


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(R, G, V, generator=gen), torch.randint(0, V, (R,), generator=gen),
            torch.randn(R, G, H, generator=gen))


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "T1", "warped"])
@pytest.mark.parametrize("kind", KINDS + [None])
def test_shapes_and_probs(kind, params):
    torch.manual_seed(0)
    head = None if kind is None else MarkovHead(V, RANK, H, kind)
    base, anchors, hidden = _inputs()
    blk = sample_block(base, anchors, head, hidden, params, torch.Generator().manual_seed(1))
    assert blk.tokens.shape == (R, G) and blk.tokens.dtype == torch.long
    assert blk.probs.shape == (R, G, V) and blk.probs.dtype == torch.float32
    torch.testing.assert_close(blk.probs.sum(-1), torch.ones(R, G))
    # every sampled token has positive probability under the distribution it came from
    assert (blk.probs.gather(-1, blk.tokens[..., None]) > 0).all()
    if head is None:
        assert blk.markov_embeds is None
    else:
        assert blk.markov_embeds.shape == (R, G, RANK)
        prev = torch.cat([anchors[:, None], blk.tokens[:, :-1]], 1)
        torch.testing.assert_close(blk.markov_embeds, head.markov_w1.weight[prev])
        # probs are exactly warp(U_k + bias(x_{k-1})) along the sampled path
        bias, _ = head.teacher_forced_bias(prev, hidden)
        torch.testing.assert_close(blk.probs, warp_probs(base + bias, params))
    assert not base.requires_grad


@pytest.mark.parametrize("kind", KINDS + [None])
def test_greedy_is_deterministic_and_argmax(kind):
    torch.manual_seed(0)
    head = None if kind is None else MarkovHead(V, RANK, H, kind)
    base, anchors, hidden = _inputs()
    a = sample_block(base, anchors, head, hidden, SamplingParams(), torch.Generator().manual_seed(1))
    b = sample_block(base, anchors, head, hidden, SamplingParams(), None)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.probs.amax(-1), torch.ones(R, G))


def test_seeded_sampling_is_reproducible():
    head = MarkovHead(V, RANK, H, "rnn")
    base, anchors, hidden = _inputs()
    a = sample_block(base, anchors, head, hidden, SamplingParams(1.0), torch.Generator().manual_seed(9))
    b = sample_block(base, anchors, head, hidden, SamplingParams(1.0), torch.Generator().manual_seed(9))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs)


def test_bias_makes_position_k_depend_on_previous_token():
    """Flat base logits; W2·W1 is a permutation 'x -> x+1' so greedy drafts count up from the anchor."""
    head = MarkovHead(V, V, H, "vanilla")
    with torch.no_grad():
        head.markov_w1.weight.copy_(torch.eye(V))
        head.markov_w2.weight.copy_(torch.roll(torch.eye(V), 1, dims=0) * 10)
    base = torch.zeros(R, G, V)
    anchors = torch.tensor([0, 3, 7, V - 1])
    blk = sample_block(base, anchors, head, None, SamplingParams(), None)
    expected = (anchors[:, None] + torch.arange(1, G + 1)) % V
    assert torch.equal(blk.tokens, expected)
    # DFlash (no head) on the same logits ignores the anchor entirely
    flat = sample_block(base, anchors, None, None, SamplingParams(), None)
    assert (flat.tokens == 0).all()
    # sampling: position 2's distribution changes with the sampled x_1
    blk = sample_block(base, anchors, head, None, SamplingParams(1.0), torch.Generator().manual_seed(0))
    prev = torch.cat([anchors[:, None], blk.tokens[:, :-1]], 1)
    assert torch.equal(blk.probs.argmax(-1), (prev + 1) % V)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "T1", "warped"])
@pytest.mark.parametrize("kind", KINDS + [None])
def test_without_probs_the_same_tokens_and_embeds_are_drawn(kind, params):
    """need_probs=False (greedy verification) stores no q and draws exactly the tokens it would
    have drawn with them, from the same random stream."""
    torch.manual_seed(0)
    head = None if kind is None else MarkovHead(V, RANK, H, kind)
    base, anchors, hidden = _inputs()
    full = sample_block(base, anchors, head, hidden, params, torch.Generator().manual_seed(4))
    lean = sample_block(base, anchors, head, hidden, params, torch.Generator().manual_seed(4), need_probs=False)
    assert lean.probs is None and torch.equal(lean.tokens, full.tokens)
    assert (lean.markov_embeds is None) == (full.markov_embeds is None)
    if full.markov_embeds is not None:
        assert torch.equal(lean.markov_embeds, full.markov_embeds)
    with pytest.raises(ValueError, match="without its probabilities"):
        lean.full_probs(V)


@pytest.mark.parametrize("reduced", [False, True], ids=["full vocabulary", "reduced vocabulary"])
@torch.no_grad()
def test_greedy_vanilla_fast_loop_draws_what_the_general_loop_draws(reduced):
    """Inference's greedy loop for a vanilla head (no probs kept) gives the tokens and embeddings
    the general loop gives (which keeps the one-hot q)."""
    from dsparkctl.math import draft_sampling
    torch.manual_seed(1)
    vocab = torch.tensor([0, 2, 3, 5, 8, 9, 11, 16]) if reduced else None
    head = MarkovHead(V, RANK, H, "vanilla", out_size=8 if reduced else None)
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(R, G, 8 if reduced else V, generator=gen)
    anchors = torch.randint(0, V, (R,), generator=gen)
    calls = []
    real = draft_sampling._greedy_vanilla
    draft_sampling._greedy_vanilla = lambda *a: calls.append(1) or real(*a)
    try:
        lean = sample_block(base, anchors, head, None, SamplingParams(), None, vocab_ids=vocab, need_probs=False)
    finally:
        draft_sampling._greedy_vanilla = real
    full = sample_block(base, anchors, head, None, SamplingParams(), None, vocab_ids=vocab)
    assert calls and lean.probs is None
    assert torch.equal(lean.tokens, full.tokens) and torch.equal(lean.markov_embeds, full.markov_embeds)
