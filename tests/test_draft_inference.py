"""The draft's inference backbone (block K/V written into the state's buffers, no concatenation)
against the training-style forward that concatenates the context K/V, on a tiny target."""

from __future__ import annotations

import pytest
import torch

from dsparkctl.models.draft_io import random_draft
from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import tiny_target


def _concatenating_backbone(draft, state, anchors):
    """The backbone as it was before issue 29: K/V of context and block concatenated per layer."""
    R, g = anchors.shape[0], draft.cfg.block_size
    ids = torch.full((R, g), draft.cfg.mask_token_id, dtype=torch.long)
    ids[:, 0] = anchors
    x = draft.embed_tokens(ids)
    n = int(state.ctx_len.max())
    cos, sin = draft.rotary(state.ctx_len[:, None] + torch.arange(g)[None, :], x.dtype)
    ctx_ok = torch.arange(n)[None, :] < state.ctx_len[:, None]
    mask = torch.cat([ctx_ok, ctx_ok.new_ones(R, g)], dim=1)[:, None, None, :]
    for i, layer in enumerate(draft.layers):
        x = layer(x, cos, sin, state.keys[i][:, :, :n], state.values[i][:, :, :n], mask)
    return draft.norm(x)


@pytest.mark.parametrize("lengths", [[7], [6, 6, 6], [3, 9, 5]], ids=["one row", "uniform", "ragged"])
@torch.no_grad()
def test_cached_backbone_matches_the_concatenating_one(lengths):
    model = tiny_target("qwen3", layers=4)
    tgt = TargetAdapter(model, [0, 1])
    draft = random_draft(tgt, seed=2, block_size=4, markov_rank=4, layer_ids=[0, 1], num_layers=2)
    R = len(lengths)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=gen).tolist() for n in lengths]
    pre = tgt.prefill(prompts)
    state = draft.new_state(R, "cpu", torch.float32, capacity=max(lengths))  # the block must make room
    draft.append_context(state, pre.features, torch.tensor(lengths))
    keys_before = [k.clone() for k in state.keys]
    anchors = torch.randint(3, 64, (R,), generator=gen)
    ref = _concatenating_backbone(draft, state, anchors)
    got = draft.backbone(state, anchors)
    if len(set(lengths)) == 1:
        assert torch.equal(got, ref)  # the same keys in the same order
    else:
        torch.testing.assert_close(got, ref)  # masked slots in between: another summation order
    assert state.ctx_len.tolist() == lengths
    for before, after in zip(keys_before, state.keys):  # the context itself is untouched
        for r, n in enumerate(lengths):
            assert torch.equal(after[r, :, :n], before[r, :, :n])


def _state_with_pending(draft, tgt, lengths, pending, seed=0):
    """A state holding `lengths` context tokens, with `pending` more tokens' features deferred
    (one chunk per entry of `pending`, every row the same count) as the engine leaves it."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 64, (n + sum(pending),), generator=gen).tolist() for n in lengths]
    pre = tgt.prefill(prompts)
    R = len(lengths)
    state = draft.new_state(R, "cpu", torch.float32, capacity=4)  # every append and block must make room
    draft.append_context(state, pre.features[:, : max(lengths)], torch.tensor(lengths))
    at = max(lengths)
    for c in pending:
        fed = pre.features[:, at: at + c + 1] if at + c + 1 <= pre.features.shape[1] else pre.features[:, at: at + c]
        draft.defer_context(state, fed, torch.full((R,), c))  # a feed may be wider than what was kept
        at += c
    return state, torch.randint(3, 64, (R,), generator=gen)


def _per_op(monkeypatch):
    from dsparkctl.models.draft_layers import DraftLayer
    monkeypatch.setattr(DraftLayer, "fused", lambda self: None)


@pytest.mark.parametrize("lengths,pending", [([7], [3]), ([7], [1, 1, 2]), ([6, 6], [2]), ([6, 6], []),
                                             ([5, 9], [2])], ids=["one row", "three chunks", "uniform",
                                                                  "nothing pending", "ragged"])
@torch.no_grad()
def test_fused_backbone_matches_the_per_op_one(lengths, pending, monkeypatch):
    """The pending context taken into the layers' fused q/k/v products gives what appending it
    first and running each projection alone gives: hidden states, context K/V and lengths."""
    tgt = TargetAdapter(tiny_target("qwen3", layers=4), [0, 1])
    draft = random_draft(tgt, seed=3, block_size=4, markov_rank=4, layer_ids=[0, 1], num_layers=2)
    from dsparkctl.models.draft_layers import DraftLayer
    calls = []
    fused_forward = DraftLayer.forward_fused
    monkeypatch.setattr(DraftLayer, "forward_fused", lambda self, *a: calls.append(1) or fused_forward(self, *a))
    runs = []
    for fused in (True, False):
        if not fused:
            assert len(calls) == (2 if len(set(lengths)) == 1 else 0)  # uniform rows take the fused path
            _per_op(monkeypatch)
        state, anchors = _state_with_pending(draft, tgt, lengths, pending)
        h = draft.backbone(state, anchors)
        runs.append((h, state))
    assert len(calls) == (2 if len(set(lengths)) == 1 else 0)
    (h_f, s_f), (h_p, s_p) = runs
    torch.testing.assert_close(h_f, h_p, rtol=1e-5, atol=1e-5)
    assert s_f.ctx_len.tolist() == s_p.ctx_len.tolist() == [n + sum(pending) for n in lengths]
    assert not s_f.pending and not s_p.pending
    for kf, kp, vf, vp in zip(s_f.keys, s_p.keys, s_f.values, s_p.values):
        for r, n in enumerate(s_f.ctx_len.tolist()):
            torch.testing.assert_close(kf[r, :, :n], kp[r, :, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vf[r, :, :n], vp[r, :, :n], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_fused_copies_follow_the_weights():
    """Fused copies are remade when a weight changes in place (training between evaluations)."""
    tgt = TargetAdapter(tiny_target("qwen3", layers=4), [0, 1])
    draft = random_draft(tgt, seed=4, block_size=4, markov_rank=4, layer_ids=[0, 1], num_layers=2)
    layer = draft.layers[0]
    before = layer.fused()
    assert before is not None and layer.fused()[0] is before[0]  # made once, then reused
    layer.self_attn.k_proj.weight.mul_(2.0)
    layer.self_attn.k_norm.weight.add_(0.5)
    after = layer.fused()
    assert after[0] is not before[0]
    kv = layer.self_attn.n_heads * layer.self_attn.head_dim
    assert torch.equal(after[0].weight[kv: kv + layer.self_attn.k_proj.out_features], layer.self_attn.k_proj.weight)
    assert torch.equal(after[2][-1], layer.self_attn.k_norm.weight)
    # an update that bumps no version (fused AdamW writes that way; here through .data) is caught by
    # train(), which every training loop calls, and by the trainer after each step
    layer.mlp.up_proj.weight.data.add_(1.0)
    assert layer.fused()[1] is after[1]
    draft.train()
    draft.eval()
    fresh = layer.fused()
    up = layer.mlp.up_proj
    assert fresh[1] is not after[1] and torch.equal(fresh[1].weight[-up.out_features:], up.weight)


@pytest.mark.parametrize("change", [{"qk_norm": False}, {"attention_bias": True}, {"num_key_value_heads": 4}],
                         ids=["no qk norm", "attention bias", "no grouped heads"])
@torch.no_grad()
def test_fused_path_covers_other_layer_shapes(change, monkeypatch):
    """Without q/k norms, with projection biases, or with as many K/V heads as query heads, the
    fused path still gives the per-op path's hidden states."""
    import dataclasses

    from dsparkctl.models.draft import DSparkDraft
    from dsparkctl.models.draft_io import init_weights, random_draft_config
    tgt = TargetAdapter(tiny_target("qwen3", layers=4), [0, 1])
    cfg = dataclasses.replace(random_draft_config(tgt, block_size=4, markov_rank=4, layer_ids=[0, 1], num_layers=2),
                              **change)
    draft = DSparkDraft(cfg)
    init_weights(draft, torch.Generator().manual_seed(0))
    for layer in draft.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            if lin.bias is not None:
                lin.bias.normal_()
    draft.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())
    draft.eval()
    assert all(layer.fused() is not None for layer in draft.layers)
    hs = []
    for fused in (True, False):
        if not fused:
            _per_op(monkeypatch)
        state, anchors = _state_with_pending(draft, tgt, [6], [2])
        hs.append(draft.backbone(state, anchors))
    torch.testing.assert_close(hs[0], hs[1], rtol=1e-5, atol=1e-5)
