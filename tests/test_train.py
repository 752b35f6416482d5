"""Training: recipe loader, the objective on hand values, data capture, exact resume, CLI errors."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.errors import InputError
from dsparkctl.models.target import TargetAdapter
from dsparkctl.train.batches import make_batch
from dsparkctl.train.draft_init import init_draft
from dsparkctl.train.loss import dspark_loss, lr_at, position_weights, sparse_l1
from dsparkctl.train.parts import unpack
from dsparkctl.train.recipe import load_recipe, parse_overrides
from dsparkctl.train.target_passes import regenerate_part
from dsparkctl.train.trainer import Trainer
from tests.helpers import regenerated_tiny, tiny_recipe, write_tiny_prompts
from tests.tiny_models import tiny_target

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-dspark.toml"


# ------------------------------------------------------------------ recipes
def test_shipped_recipe_loads_and_rank0_override():
    r = load_recipe(RECIPE)
    assert r.draft.block_size == 5 and r.draft.markov_rank == 64 and r.draft.layer_ids == (1, 10, 19, 28)
    assert r.draft.vocab_size == 8192 and r.draft.init == "target"
    r0 = load_recipe(RECIPE, ["markov_rank=0"])
    assert r0.draft.markov_rank == 0 and r0.data_digest() == r.data_digest()  # rank 0 reuses the data cache
    assert r0.digest() != r.digest()


@pytest.mark.parametrize("toml, message", [
    ("[draft]\nnum_layer = 2\n", "unknown recipe key draft.num_layer"),
    ("[drafts]\nnum_layers = 2\n", "unknown recipe key 'drafts'"),
    ("[draft]\nblock_size = 'five'\n", "expected int"),
    ("[draft]\nlayer_ids = [3, 1]\n", "strictly increasing"),
    ("[eval]\nholdout = 0\n", "eval.holdout"),
    ("[draft\n", "not valid TOML"),
    ("[data]\nprecision = 'fp16'\n", "data.precision"),
    ("[optim]\nprecision = 'half'\n", "optim.precision"),
])
def test_bad_recipes(tmp_path, toml, message):
    p = tmp_path / "r.toml"
    p.write_text(toml)
    with pytest.raises(InputError, match=message):
        load_recipe(p)


@pytest.mark.parametrize("pairs, expected", [
    (["draft.markov_rank=0"], {"draft": {"markov_rank": 0}}),
    (["lr=3e-4", "layer_ids=[2, 4]"], {"optim": {"lr": 3e-4}, "draft": {"layer_ids": [2, 4]}}),
    (["dataset=humaneval"], {"data": {"dataset": "humaneval"}}),
])
def test_overrides(pairs, expected):
    assert parse_overrides(pairs) == expected


@pytest.mark.parametrize("pairs, message", [(["seed=1"], "ambiguous"), (["nope=1"], "unknown recipe key"),
                                            (["markov_rank"], "key=value"), (["draft.nope=1"], "draft.nope")])
def test_bad_overrides(pairs, message):
    with pytest.raises(InputError, match=message):
        load_recipe(RECIPE, pairs)


# ------------------------------------------------------------------ objective
def _dense_l1(q, p):
    return (q - p).abs().sum(-1)


def test_loss_on_hand_values():
    # one block, γ = 2, draft vocabulary = full V = 2; draft uniform, target one-hot on 0 then uniform
    d = torch.zeros(1, 2, 2)
    topk_idx = torch.tensor([[[0, 1], [0, 1]]])
    topk_p = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])
    tok = torch.tensor([[0, 1]])
    conf = torch.zeros(1, 2)
    parts = dspark_loss(d, topk_idx, topk_p, tok, conf, torch.ones(1, 2, dtype=torch.bool))
    l1 = [1.0, 0.0]  # ‖(.5,.5) − (1,0)‖₁ = 1; second slot identical
    w = [1.0, math.exp(-1 / 2)]
    ce = math.log(2)
    overlap = [0.5, 1.0]
    bce = sum(-(c * math.log(0.5) + (1 - c) * math.log(0.5)) for c in overlap) / 2
    assert parts.ce == pytest.approx(ce)
    assert parts.l1 == pytest.approx(w[0] * l1[0] + w[1] * l1[1])
    assert parts.bce == pytest.approx(bce)
    assert float(parts.total) == pytest.approx(0.1 * ce + 0.9 * (w[0] * l1[0] + w[1] * l1[1]) + bce, rel=1e-5)
    assert parts.overlap == pytest.approx(overlap)


def test_sparse_l1_equals_dense_l1_when_the_top_k_holds_all_mass():
    g = torch.Generator().manual_seed(0)
    V, k = 12, 4
    q = torch.softmax(torch.randn(5, 3, V, generator=g), -1)
    p = torch.zeros(5, 3, V)
    idx = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(15)]).view(5, 3, k)
    p.scatter_(-1, idx, torch.softmax(torch.randn(5, 3, k, generator=g), -1))
    torch.testing.assert_close(sparse_l1(q, idx, p.gather(-1, idx)), _dense_l1(q, p))
    # a reduced draft vocabulary: the draft covers ids 0..7; target mass on 8..11 is pure loss
    sub = torch.arange(8)
    q_sub = torch.softmax(torch.randn(5, 3, 8, generator=g), -1)
    q_full = torch.zeros(5, 3, V)
    q_full[..., sub] = q_sub
    to_draft = torch.full((V,), -1)
    to_draft[sub] = torch.arange(8)
    torch.testing.assert_close(sparse_l1(q_sub, to_draft[idx], p.gather(-1, idx)), _dense_l1(q_full, p))


def test_loss_ignores_invalid_slots_and_grads_flow():
    d = torch.randn(3, 4, 7, requires_grad=True)
    idx = torch.randint(0, 7, (3, 4, 3))
    pk = torch.softmax(torch.randn(3, 4, 3), -1)
    tok = torch.randint(0, 7, (3, 4))
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[2] = False
    a = dspark_loss(d, idx, pk, tok, None, valid)
    b = dspark_loss(d[:2], idx[:2], pk[:2], tok[:2], None, valid[:2])
    assert (a.ce, a.l1, a.bce) == pytest.approx((b.ce, b.l1, b.bce), rel=1e-6)
    a.total.backward()
    assert d.grad[2].abs().sum() == 0 and d.grad[:2].abs().sum() > 0


def test_position_weights_and_schedule():
    assert position_weights(5).tolist() == pytest.approx([math.exp(-k / 5) for k in range(5)])
    assert lr_at(0, 100, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_at(10, 100, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert lr_at(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)


# ------------------------------------------------------------------ data + resume on a tiny target
@pytest.fixture(scope="module")
def tiny():
    return regenerated_tiny()


def test_regenerated_features_match_a_full_forward(tiny):
    model, prompts, seqs = tiny
    assert [s.tokens[: s.prompt_len].tolist() for s in seqs] == prompts
    for s in seqs:
        out = model(s.tokens[None], output_hidden_states=True)
        taps = torch.cat([out.hidden_states[1], out.hidden_states[3]], dim=-1)[0, :-1]
        assert s.features.shape == taps.shape
        torch.testing.assert_close(s.features.float(), taps, atol=2e-2, rtol=2e-2)
        logp = torch.log_softmax(out.logits[0, s.prompt_len - 1: -1].float(), -1)  # [S-P, V]
        assert s.topk_ids.shape == (s.response_len, 8)
        v, i = logp.topk(8, -1)
        assert (s.topk_ids[:, 0].long() == i[:, 0]).all()
        torch.testing.assert_close(s.topk_logp.float(), v, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_teacher_forced_parts_keep_their_order_and_match_one_forward_each(precision):
    """Sequences are batched by length (little padding) yet come back in their own order; in bf16
    autocast the features and top-1 stay close to the fp32 pass."""
    from dsparkctl.train.target_passes import teacher_forced_part

    model = tiny_target("qwen3", vocab=64, layers=3)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (9, 30, 5, 17, 12, 28, 6)]
    plens = [3, 10, 2, 4, 5, 20, 3]
    part = teacher_forced_part(model, seqs, plens, (0, 2), pad_id=2, topk=4, chunk=3, precision=precision)
    got = unpack(part, part)
    tol = 2e-2 if precision == "fp32" else 1e-1
    for s, want, p in zip(got, seqs, plens):
        assert s.tokens.tolist() == want and s.prompt_len == p
        out = model(torch.tensor([want]), output_hidden_states=True)
        taps = torch.cat([out.hidden_states[1], out.hidden_states[3]], dim=-1)[0, :-1]
        torch.testing.assert_close(s.features.float(), taps, atol=tol, rtol=tol)
        top1 = out.logits[0, p - 1: -1].argmax(-1)
        assert (s.topk_ids[:, 0].long() == top1).float().mean() >= (1.0 if precision == "fp32" else 0.8)


def test_greedy_regeneration_is_the_top1_and_matches_plain_greedy():
    from dsparkctl.engine.speculative import plain_generate
    from dsparkctl.math.sampling import SamplingParams

    model = tiny_target("qwen3", vocab=64, layers=3)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 20, 21]]
    part = regenerate_part(model, prompts, (0,), max_new_tokens=12, temperature=0.0, stop_ids=[1], pad_id=2,
                           topk=4, generator=torch.Generator())
    ref = plain_generate(TargetAdapter(model), prompts, 12, SamplingParams(0.0), stop_token_ids=[1])
    for s, o in zip(unpack(part, part), ref.outputs):
        assert s.tokens[s.prompt_len:].tolist() == o.tokens
        assert (s.topk_ids[:, 0].long() == s.tokens[s.prompt_len:]).all()


def _trainer(model, seqs, run_dir, steps=6, extra=()):
    rec = load_recipe(None, ["num_layers=1", "layer_ids=[0, 2]", "block_size=3", "markov_rank=8",
                             "mask_token_id=2", f"steps={steps}", "checkpoint_every=3", "batch_sequences=2",
                             "anchors_per_sequence=4", "warmup_steps=2", "optim.threads=0", "holdout=1",
                             "num_prompts=4", *extra])
    draft = init_draft(rec, TargetAdapter(model), 2)
    return Trainer(rec, draft, seqs, run_dir)


def test_exact_resume(tiny, tmp_path):
    model, _, seqs = tiny
    straight = _trainer(model, seqs, tmp_path / "a")
    straight.train()
    first = _trainer(model, seqs, tmp_path / "b")
    first.train(stop_after=3)
    second = _trainer(model, seqs, tmp_path / "b")
    assert second.load_latest() == 3
    second.train()
    for (n, p), (_, q) in zip(straight.draft.named_parameters(), second.draft.named_parameters()):
        assert torch.equal(p, q), n
    losses = [float(x) for x in (tmp_path / "a" / "log.jsonl").read_text().split("\"loss\": ")[1:] for x in [x.split(",")[0]]]
    assert all(math.isfinite(v) for v in losses)


def test_training_lowers_the_loss(tiny, tmp_path):
    model, _, seqs = tiny
    tr = _trainer(model, seqs, tmp_path / "c", steps=30)
    res = tr.train()
    assert sum(l.loss for l in res.logs[-5:]) < sum(l.loss for l in res.logs[:5])


@pytest.mark.parametrize("label", ["data", "target"])
def test_the_ce_label_is_the_next_token_or_the_targets_argmax(tiny, tmp_path, monkeypatch, label):
    """Teacher-forced text: the next token is often not the target's argmax. `optim.ce_label`
    picks which one the CE term pulls toward."""
    import dsparkctl.train.trainer as trainer_mod
    model, _, seqs = tiny
    forced = [dataclasses.replace(s, topk_ids=s.topk_ids.roll(1, dims=1)) for s in seqs]  # argmax != next token
    seen = []
    real = trainer_mod.batch_loss
    monkeypatch.setattr(trainer_mod, "batch_loss", lambda d, b, *a: seen.append(b) or real(d, b, *a))
    _trainer(model, forced, tmp_path / label, steps=2, extra=[f"optim.ce_label={label!r}"]).train()
    b = seen[0]
    v, argmax = b.valid, b.topk_idx[..., 0]
    nxt = b.prev_tokens[..., 1:]  # x*_1..x*_{γ-1}: the next tokens (the tiny draft's vocabulary is the target's)
    assert not torch.equal(argmax[..., :-1][v[..., :-1]], nxt[v[..., :-1]])  # the two labels differ here
    want = argmax[..., :-1] if label == "target" else nxt
    assert torch.equal(b.target_idx[..., :-1][v[..., :-1]], want[v[..., :-1]])


def test_a_nonsense_ce_label_is_refused():
    with pytest.raises(InputError, match="ce_label"):
        load_recipe(None, ["optim.ce_label='argmax'"])


def test_batch_anchors_stay_in_the_response(tiny):
    _, _, seqs = tiny
    g = torch.Generator().manual_seed(0)
    b = make_batch(seqs, 4, 3, g, torch.arange(64))
    for i, s in enumerate(seqs):
        for n in range(4):
            if b.valid[i, n, 0]:
                a = int(b.anchor_pos[i, n])
                assert s.prompt_len <= a <= len(s.tokens) - 1 - 3
                assert b.target_idx[i, n].tolist() == s.tokens[a + 1: a + 4].tolist()
                # slot k predicts the token at a+k: its target distribution is top-k row a+k-P
                rows = slice(a + 1 - s.prompt_len, a + 4 - s.prompt_len)
                assert b.topk_idx[i, n].tolist() == s.topk_ids[rows].tolist()
                torch.testing.assert_close(b.topk_p[i, n], s.topk_logp[rows].float().exp())


# ------------------------------------------------------------------ CLI one-liners
def test_cli_unknown_recipe_key_is_one_line(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[optim]\nstepz = 3\n")
    res = CliRunner().invoke(app, ["train", str(p)])
    assert res.exit_code != 0
    assert "unknown recipe key optim.stepz" in res.output and len(res.output.strip().splitlines()) == 1


def test_cli_missing_dataset_field_is_one_line(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"question": "hi"}\n')
    res = CliRunner().invoke(app, ["eval-acceptance", "--dataset", str(data), "--field", "prompt"])
    assert res.exit_code != 0 and "field 'prompt' is missing" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_cli_train_end_to_end_resume_and_export(tmp_path):
    from tests.tiny_models import save_tiny_target

    target = save_tiny_target(tmp_path / "target", "llama", vocab=64, layers=4)
    prompts = write_tiny_prompts(tmp_path / "p.txt")
    recipe = tmp_path / "r.toml"
    recipe.write_text(tiny_recipe(target, prompts, data={"num_prompts": 10, "max_new_tokens": 12, "temperature": 1.0},
                                  optim={"steps": 4, "checkpoint_every": 2, "keep_checkpoints": [2], "threads": 0}))
    cache = tmp_path / "cache"
    args = ["train", str(recipe), "--cache-dir", str(cache), "--json"]
    res = CliRunner().invoke(app, args + ["--max-steps", "2"])
    assert res.exit_code == 0, res.output
    first = json.loads(res.stdout)
    assert first["steps"] == 2 and first["train_sequences"] == 8 and first["heldout_sequences"] == 2
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0 and "--resume" in res.output
    res = CliRunner().invoke(app, args + ["--resume", "--set", "holdout=2"])
    assert res.exit_code == 0, res.output
    done = json.loads(res.stdout)
    assert done["steps"] == 4 and done["resumed_from"] == 2
    assert done["heldout_teacher_forced"]["tau"] >= 1.0
    cfg = json.loads((Path(done["draft"]) / "config.json").read_text())
    assert cfg["markov_rank"] == 8 and cfg["dsparkctl"]["steps"] == 4
    out = tmp_path / "step2"
    res = CliRunner().invoke(app, ["train", str(recipe), "--cache-dir", str(cache), "--export-step", "2", "--out", str(out),
                                   "--json"])
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").is_file()
    assert json.loads(res.stdout)["exported_step"] == 2  # --json prints the export's document too


def test_cached_heldout_tau_equals_a_real_teacher_forced_evaluation(tmp_path):
    """The training-time held-out τ (from cached features and top-1) is the same number the
    teacher-forced evaluator computes with a real target forward: same anchors, same slots."""
    from dsparkctl.evaluation.teacher_forced import evaluate_sequences
    from dsparkctl.math.sampling import SamplingParams
    from dsparkctl.train.job import heldout_stats

    model = tiny_target("llama", vocab=64, layers=4)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [20, 21]]
    part = regenerate_part(model, prompts, (0, 2), max_new_tokens=20, temperature=0.0, stop_ids=[1], pad_id=2,
                           topk=8, generator=torch.Generator())
    seqs = unpack(part, part)
    tr = _trainer(model, seqs, tmp_path / "r", steps=15)
    tr.train()
    cached = heldout_stats(tr.draft, seqs, 0.0)
    real = evaluate_sequences(tr.draft, model, [s.tokens.tolist() for s in seqs], [s.prompt_len for s in seqs],
                              SamplingParams(0.0))
    assert cached.anchors == real.anchors > 0
    assert cached.tau == pytest.approx(real.tau, abs=1e-6)
    assert cached.conditional() == pytest.approx(real.conditional(), abs=1e-6)


def test_init_from_a_draft_folder_continues_it(tmp_path):
    """A fresh machine without the run folder continues a shipped draft: init_from loads every
    trained tensor (the tap scale folded into fc is unfolded), the optimizer starts fresh."""
    from dsparkctl.models.draft_io import load_draft
    from dsparkctl.train.draft_init import export_draft, load_init_draft, tap_scale
    from dsparkctl.train.job import trainable

    model = tiny_target("llama", vocab=64, layers=4)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [20, 21]]
    part = regenerate_part(model, prompts, (0, 2), max_new_tokens=20, temperature=0.0, stop_ids=[1], pad_id=2,
                           topk=8, generator=torch.Generator())
    seqs = unpack(part, part)
    base = ["num_layers=1", "layer_ids=[0, 2]", "block_size=3", "markov_rank=8", "mask_token_id=2", "vocab_size=40",
            "tap_norm=true", "holdout=1", "num_prompts=5"]
    rec = load_recipe(None, base)
    tgt = TargetAdapter(model, [0, 2])
    draft = init_draft(rec, tgt, 2)
    from dsparkctl.train.draft_init import select_vocab
    draft.set_draft_vocab(select_vocab(seqs, 40, 64))
    draft.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())
    scale = tap_scale(seqs, 2)
    Trainer(rec, draft, seqs, tmp_path / "a", feature_scale=scale).train(stop_after=5)
    export_draft(draft, tmp_path / "exported", scale, {"dsparkctl": {"test": True}})
    # the exported file needs no extra op: fc has the scale folded in
    loaded = load_draft(tmp_path / "exported", tgt)
    feats = seqs[1].features.float()[None]
    a = torch.tensor([[seqs[1].prompt_len]])
    h_trained = draft.forward_blocks(feats * scale, seqs[1].tokens[None, a[0, 0]: a[0, 0] + 1], a)
    h_loaded = loaded.float().forward_blocks(feats, seqs[1].tokens[None, a[0, 0]: a[0, 0] + 1], a)
    torch.testing.assert_close(h_loaded, h_trained, atol=0.05, rtol=0.05)
    # a second recipe starting from it
    rec2 = load_recipe(None, base + [f"init_from={tmp_path / 'exported'}"])
    fresh = init_draft(rec2, tgt, 2)
    fresh.set_draft_vocab(select_vocab(seqs, 40, 64))
    load_init_draft(rec2, fresh, tgt, scale)
    assert torch.equal(fresh.draft_vocab_ids, draft.draft_vocab_ids)
    for n, p in trainable(fresh).items():
        torch.testing.assert_close(p, trainable(draft)[n], atol=2e-2, rtol=2e-2)  # bf16 file


@pytest.mark.parametrize("bias", [False, True])
def test_init_from_a_shallower_draft_grows_it_as_identity_layers(tmp_path, bias):
    """A 1-layer draft continued as a 2-layer one: its layer is the first, the new layer adds
    nothing to the residual stream at the start (same hidden states; with a target whose
    projections have biases too, which init = target copies), and training moves it. A deeper
    source than the recipe is refused by name."""
    from dsparkctl.models.draft_io import load_draft
    from dsparkctl.train.draft_init import GROWN_ZEROS, check_against_target, export_draft, load_init_draft

    model = tiny_target("llama", vocab=64, layers=4)
    if bias:
        from transformers import LlamaForCausalLM
        cfg = model.config
        cfg.attention_bias = cfg.mlp_bias = True
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.uniform_(-0.5, 0.5)
    tgt = TargetAdapter(model, [0, 2])
    base = ["layer_ids=[0, 2]", "block_size=3", "markov_rank=8", "mask_token_id=2", "vocab_size=0", "init=target",
            "holdout=1", "num_prompts=5", "tap_norm=false"]
    shallow = init_draft(load_recipe(None, base + ["num_layers=1"]), tgt, 2)
    with torch.no_grad():  # a trained-looking source: nothing zero, so a copy is told from a fresh tensor
        for p in shallow.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    export_draft(shallow, tmp_path / "one", None, {})
    rec = load_recipe(None, base + ["num_layers=2", f"init_from={tmp_path / 'one'}"])
    check_against_target(rec, model)
    grown = init_draft(rec, tgt, 2)
    assert not bias or grown.layers[1].self_attn.o_proj.bias.any()  # copied from the target: must be zeroed
    load_init_draft(rec, grown, tgt, None)
    src = load_draft(tmp_path / "one", tgt, dtype=torch.float32, device="cpu")
    feats = torch.randn(1, 6, 2 * 32, generator=torch.Generator().manual_seed(0))
    tok, a = torch.tensor([[7]]), torch.tensor([[3]])
    torch.testing.assert_close(grown.forward_blocks(feats, tok, a), src.forward_blocks(feats, tok, a))
    new = {n: p for n, p in grown.named_parameters() if n.startswith("layers.1.")}
    assert all(not p.any() for n, p in new.items() if n.endswith(GROWN_ZEROS))
    assert all(p.any() for n, p in new.items() if not n.endswith(GROWN_ZEROS))
    # the zeroed projections get a gradient, so the new layer learns
    grown.forward_blocks(feats, tok, a).pow(2).sum().backward()
    assert new["layers.1.self_attn.o_proj.weight"].grad.abs().sum() > 0
    assert new["layers.1.mlp.down_proj.weight"].grad.abs().sum() > 0
    # shrinking is refused before any data is built
    export_draft(grown, tmp_path / "two", None, {})
    with pytest.raises(InputError, match="num_hidden_layers is 2, the recipe's draft has 1"):
        check_against_target(load_recipe(None, base + ["num_layers=1", f"init_from={tmp_path / 'two'}"]), model)


@pytest.mark.parametrize("grown_k", [48, 0])
def test_init_from_a_smaller_vocabulary_grows_it_around_the_source(tmp_path, grown_k):
    """A K=24 draft continued with K=48 or the full vocabulary: the source's tokens stay (the rest
    by frequency), each keeps its Markov row, new rows start at zero, so over the source's tokens
    the grown draft's logits are exactly the source's. Shrinking is refused before any data."""
    from dsparkctl.models.draft_io import load_draft
    from dsparkctl.train.draft_init import check_against_target, export_draft, load_init_draft, select_vocab

    model = tiny_target("llama", vocab=64, layers=4)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [20, 21]]
    part = regenerate_part(model, prompts, (0, 2), max_new_tokens=20, temperature=0.0, stop_ids=[1], pad_id=2,
                           topk=8, generator=torch.Generator())
    seqs = unpack(part, part)
    tgt = TargetAdapter(model, [0, 2])
    base = ["num_layers=1", "layer_ids=[0, 2]", "block_size=3", "markov_rank=8", "mask_token_id=2",
            "tap_norm=false", "holdout=1", "num_prompts=5"]
    small = init_draft(load_recipe(None, base + ["vocab_size=24"]), tgt, 2)
    small.set_draft_vocab(torch.arange(40, 64))  # rare tokens, so frequency alone would not keep them
    small.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())
    with torch.no_grad():
        small.markov_head.markov_w2.weight.normal_(generator=torch.Generator().manual_seed(1))
    export_draft(small, tmp_path / "small", None, {})
    src = load_draft(tmp_path / "small", tgt, dtype=torch.float32, device="cpu")
    rec = load_recipe(None, base + [f"vocab_size={grown_k}", f"init_from={tmp_path / 'small'}"])
    check_against_target(rec, model)
    grown = init_draft(rec, tgt, 2)
    if grown_k:
        grown.set_draft_vocab(select_vocab(seqs, grown_k, 64))
        grown.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())
    load_init_draft(rec, grown, tgt, None, seqs)
    ids = grown.draft_vocab_ids if grown_k else torch.arange(64)
    assert set(range(40, 64)) <= set(ids.tolist()) and len(ids) == (grown_k or 64)
    assert ids.tolist() == sorted(ids.tolist())
    if grown_k:  # the other 24 are the most frequent response tokens outside the source's (ties: lower id)
        counts = sum(torch.bincount(s.tokens[s.prompt_len:], minlength=64) for s in seqs)
        rest = sorted(range(40), key=lambda t: (-int(counts[t]), t))[:24]
        assert set(ids.tolist()) - set(range(40, 64)) == set(rest)
    rows = torch.searchsorted(ids, torch.arange(40, 64))
    w2 = grown.markov_head.markov_w2.weight
    torch.testing.assert_close(w2[rows], src.markov_head.markov_w2.weight)
    others = torch.ones(len(ids), dtype=torch.bool)
    others[rows] = False
    assert not w2[others].any()
    feats = torch.randn(1, 6, 2 * 32, generator=torch.Generator().manual_seed(0))
    tok, a, prev = torch.tensor([[7]]), torch.tensor([[3]]), torch.tensor([[7, 41, 50]])
    lg, _ = grown.block_logits(grown.forward_blocks(feats, tok, a), prev)
    ls, _ = src.block_logits(src.forward_blocks(feats, tok, a), prev)
    torch.testing.assert_close(lg[..., rows], ls)
    with pytest.raises(InputError, match="can grow, not shrink"):
        check_against_target(load_recipe(None, base + ["vocab_size=16", f"init_from={tmp_path / 'small'}"]), model)
