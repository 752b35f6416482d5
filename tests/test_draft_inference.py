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
