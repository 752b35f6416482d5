"""The target adapter's batched cache: ragged feeds, per-row rollback, compaction, row removal."""

from __future__ import annotations

import torch

from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import tiny_target


def _full_logits(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


def test_ragged_rounds_match_unbatched_forwards():
    """Random ragged feeds and partial commits for 3 rows; every fed position's logits must equal
    a fresh single-sequence forward over that row's committed history plus the feed."""
    model = tiny_target("llama", vocab=64, layers=3, seed=2)
    ad = TargetAdapter(model, [0])
    g = torch.Generator().manual_seed(0)
    rows = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]
    ad.prefill(rows)
    hist = [list(r) for r in rows]
    compactions = 0
    for step in range(25):
        lengths = torch.randint(1, 6, (3,), generator=g)
        T = int(lengths.max())
        ids = torch.randint(3, 64, (3, T), generator=g)
        slots_before = ad.cache_slots()
        out = ad.extend(ids, lengths)
        for r in range(3):
            n = int(lengths[r])
            ref = _full_logits(model, hist[r] + ids[r, :n].tolist())[-n:]
            assert torch.allclose(out.logits[r, :n], ref, atol=1e-4), (step, r)
        keep = torch.stack([torch.randint(0, int(l) + 1, (1,), generator=g)[0] for l in lengths])
        ad.commit(keep)
        for r in range(3):
            hist[r] += ids[r, : int(keep[r])].tolist()
        assert ad.seq_len.tolist() == [len(h) for h in hist]
        if ad.cache_slots() < slots_before:
            compactions += 1
    assert compactions > 0, "the test should exercise cropping/compaction"
    # drop the middle row; the others continue exactly
    ad.keep_rows(torch.tensor([0, 2]))
    ids = torch.tensor([[5, 6], [7, 0]])
    out = ad.extend(ids, torch.tensor([2, 1]))
    assert torch.allclose(out.logits[0, :2], _full_logits(model, hist[0] + [5, 6])[-2:], atol=1e-4)
    assert torch.allclose(out.logits[1, :1], _full_logits(model, hist[2] + [7])[-1:], atol=1e-4)


def test_batch_one_rollback_is_an_exact_crop():
    model = tiny_target("qwen3", seed=1)
    ad = TargetAdapter(model)
    ad.prefill([[1, 2, 3]])
    ad.extend(torch.tensor([[4, 5, 6, 7]]), torch.tensor([4]))
    ad.commit(torch.tensor([1]))
    assert ad.cache_slots() == 4 and bool(ad.valid.all())


def test_features_are_raw_layer_outputs():
    model = tiny_target("llama", layers=3)
    ad = TargetAdapter(model, [-1, 0, 1])
    out = ad.prefill([[1, 2, 3, 4]])
    with torch.no_grad():
        hs = model(torch.tensor([[1, 2, 3, 4]]), output_hidden_states=True).hidden_states
    ref = torch.cat([hs[0], hs[1], hs[2]], dim=-1)
    assert torch.allclose(out.features, ref, atol=1e-5)


def test_last_layer_cannot_be_tapped():
    import pytest

    from dsparkctl.errors import ModelMismatchError
    with pytest.raises(ModelMismatchError, match="out of range"):
        TargetAdapter(tiny_target("llama", layers=3), [2])
