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


def test_taps_are_caught_by_hooks_and_equal_every_hidden_state_route():
    """forward_taps hooks only the tapped layers (no output_hidden_states): bit-equal to the
    hidden-state route, on a causal LM and on its base model, in the order given, hooks removed."""
    import pytest

    from dsparkctl.models import target as tg

    for family in ("llama", "qwen3"):
        model = tiny_target(family, layers=4, seed=2).eval()
        ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
        hooks = lambda m: [len(layer._forward_hooks) for layer in tg.decoder_layers(m)]  # noqa: E731
        with torch.no_grad():
            hs = model(ids, output_hidden_states=True).hidden_states
            before = hooks(model)  # transformers may hook the layers itself (once, on its first call)
            for module in (model, model.model):
                out, feats = tg.forward_taps(module, [2, 0], ids.device, input_ids=ids)
                assert torch.equal(feats, torch.cat([hs[3], hs[1]], dim=-1))
                assert getattr(out, "hidden_states", None) is None  # not every layer's kept
                assert hooks(module) == before
            # a forward that fails leaves no hook behind
            with pytest.raises(Exception):
                tg.forward_taps(model, [1], ids.device, input_ids=ids[:, :0].float())
            assert hooks(model) == before


def test_taps_find_the_text_decoder_of_a_multimodal_model_and_layers_replaced_after_loading():
    """A vision tower with as many layers as the text model is not what gets hooked (get_decoder
    names the text decoder); layers swapped after the first lookup are the ones hooked."""
    import copy

    import pytest

    from dsparkctl.models import target as tg

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma3ForConditionalGeneration"):
        pytest.skip("this transformers has no Gemma3")
    cfg = transformers.Gemma3Config(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                         layer_types=["full_attention"] * 4),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                           image_size=28, patch_size=14), mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        _, feats = tg.forward_taps(model, [0, 2], ids.device, input_ids=ids)
        assert torch.equal(feats, torch.cat([hs[1], hs[3]], dim=-1))
        llama = tiny_target("llama", layers=4, seed=3).eval()
        tg.forward_taps(llama, [1], ids.device, input_ids=ids)
        llama.model.layers = copy.deepcopy(llama.model.layers)
        _, feats = tg.forward_taps(llama, [1], ids.device, input_ids=ids)
        assert torch.equal(feats, llama(ids, output_hidden_states=True).hidden_states[2])


def test_last_layer_cannot_be_tapped():
    import pytest

    from dsparkctl.errors import ModelMismatchError
    with pytest.raises(ModelMismatchError, match="out of range"):
        TargetAdapter(tiny_target("llama", layers=3), [2])


def test_verify_attention_folds_query_heads_without_changing_the_result():
    """The adapter routes a grouped-query target's SDPA through `folded_sdpa`, which must give
    transformers' own SDPA result (K/V repeated per head) for several new tokens under a ragged mask,
    and hand every case it does not fold back to it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dsparkctl.models.target_attention import NAME, fold_gqa, folded_sdpa

    model = tiny_target("llama", vocab=64, layers=2, seed=3)
    TargetAdapter(model, [0])
    assert model.config._attn_implementation == NAME
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    B, h, kvh, T, S, d = 3, 4, 2, 4, 11, 8
    q, k, v = (torch.randn(B, n, t, d, generator=g) for n, t in ((h, T), (kvh, S), (kvh, S)))
    mask = torch.rand(B, 1, T, S, generator=g) < 0.7
    mask[..., 0] = True  # every query sees at least one key
    for m in (mask, torch.zeros(B, 1, T, S).masked_fill(~mask, -1e9)):
        ours, _ = folded_sdpa(attn, q, k, v, m, scaling=d ** -0.5)
        ref, _ = sdpa_attention_forward(attn, q, k, v, m, scaling=d ** -0.5)
        assert ours.shape == ref.shape == (B, T, h, d)
        assert torch.allclose(ours, ref, atol=1e-5)
    # a per-head mask and a single token go to transformers' function
    per_head = mask.expand(B, h, T, S).clone()
    assert torch.equal(folded_sdpa(attn, q, k, v, per_head, scaling=0.3)[0],
                       sdpa_attention_forward(attn, q, k, v, per_head, scaling=0.3)[0])
    eager = tiny_target("llama", vocab=64, layers=1, seed=3)
    eager.set_attn_implementation("eager")
    assert not fold_gqa(eager) and eager.config._attn_implementation == "eager"


def test_a_prefill_keeps_transformers_attention():
    """Wider than a verification (a prefill), the fold hands over: no rep·T·S mask is built."""
    from dsparkctl.models.target_attention import MAX_FOLD_TOKENS, folded_sdpa

    model = tiny_target("llama", vocab=64, layers=1, seed=4)
    TargetAdapter(model, [])
    attn = model.model.layers[0].self_attn
    T = MAX_FOLD_TOKENS + 1
    q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    mask = torch.ones(1, 1, T, T, dtype=torch.bool).tril()
    import dsparkctl.models.target_attention as ta

    before = ta._last_mask[0]
    folded_sdpa(attn, q, k, v, mask, scaling=0.3)
    assert ta._last_mask[0] is before  # nothing folded, nothing cached


def test_a_prefill_over_budget_goes_in_chunks_and_decodes_the_same(monkeypatch):
    """Many or long ragged prompts are prefilled in chunks (neither R × T × V logits nor an R × T²
    mask at once): the last logits and tapped features equal one whole forward's, and speculative
    and plain decoding after it give the same tokens."""
    from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
    from dsparkctl.math.policy_spec import parse_policy
    from dsparkctl.math.sampling import SamplingParams
    from dsparkctl.models.draft_io import random_draft

    model = tiny_target("llama", vocab=64, layers=3, seed=2)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8], [9, 10, 11, 12, 13], [3]]
    whole = TargetAdapter(model, [0, 1]).prefill(prompts)
    assert whole.logits is not None
    monkeypatch.setattr(TargetAdapter, "PREFILL_BUDGET", 4 * 64 * 3)  # chunks of 3 tokens
    ad = TargetAdapter(model, [0, 1])
    parts = ad.prefill(prompts)
    assert parts.logits is None and torch.allclose(parts.last_logits, whole.last_logits, atol=1e-5)
    for r, p in enumerate(prompts):
        assert torch.allclose(parts.features[r, : len(p)], whole.features[r, : len(p)], atol=1e-5)
    assert ad.seq_len.tolist() == [len(p) for p in prompts]
    draft = random_draft(ad, seed=3, block_size=4, markov_rank=8, layer_ids=[0, 1])
    rep = SpeculativeEngine(ad, draft, parse_policy("static:4"), SamplingParams(0.0)).generate(prompts, 20)
    monkeypatch.setattr(TargetAdapter, "PREFILL_BUDGET", 2 ** 27)
    base = plain_generate(TargetAdapter(model), prompts, 20, SamplingParams(0.0))
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in base.outputs]
