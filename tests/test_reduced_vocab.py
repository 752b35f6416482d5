"""Reduced draft vocabulary (FR-Spec style): exactness, the file format and its bad inputs.

The draft's head covers K of the target's V ids (`draft_vocab_ids`); a token outside the subset
has draft probability 0. Verification must stay exact: greedy output equals plain greedy output
token for token, and sampled output follows the target distribution (chi-square).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.errors import CheckpointError
from dsparkctl.evaluation.teacher_forced import sequence_betas
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams, warp_probs
from dsparkctl.math.sps import SPSTable
from dsparkctl.models.draft_io import load_draft, random_draft, save_draft
from dsparkctl.models.target import TargetAdapter
from tests.test_engine import PROMPTS, _exact_three_token_distribution, assert_three_tokens_distributed_as
from tests.tiny_models import save_tiny_target, tiny_target

SPS = SPSTable([1, 2, 4, 8, 16, 32], [100.0, 99.0, 97.0, 90.0, 80.0, 60.0])


def reduced_oracle(tgt: TargetAdapter, keep: torch.Tensor, block_size: int = 4, strength: float = 30.0):
    """A reduced-vocabulary draft whose Markov head encodes the target's greedy bigrams where the
    successor is inside the subset `keep` (ascending target ids)."""
    V = tgt.vocab_size
    plain = plain_generate(TargetAdapter(tgt.model), PROMPTS, 40, SamplingParams(0.0))
    nxt = {}
    for p, o in zip(PROMPTS, plain.outputs):
        seq = list(p) + o.tokens
        nxt.update(zip(seq, seq[1:]))
    draft = random_draft(tgt, seed=1, block_size=block_size, markov_rank=V, layer_ids=[0, 1],
                         draft_vocab_size=len(keep))
    draft.set_draft_vocab(keep)
    draft.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())
    pos = {int(t): i for i, t in enumerate(keep)}
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.copy_(torch.eye(V))
        w2 = torch.zeros(len(keep), V)
        for a, b in nxt.items():
            if b in pos:
                w2[pos[b], a] = strength
        draft.markov_head.markov_w2.weight.copy_(w2)
    return draft, plain, nxt


def _subset(nxt: dict, V: int, drop: int, seed: int = 0) -> torch.Tensor:
    """Keep every id but `drop` of the greedy successors (so some target tokens cannot be drafted)."""
    succ = sorted(set(nxt.values()))
    g = torch.Generator().manual_seed(seed)
    gone = {succ[i] for i in torch.randperm(len(succ), generator=g)[:drop].tolist()}
    return torch.tensor([t for t in range(V) if t not in gone])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", ["static:4", "static:2", "dspark"])
def test_greedy_identity_with_a_reduced_vocabulary(family, policy):
    model = tiny_target(family)
    tgt = TargetAdapter(model, [0, 1])
    _, plain, nxt = reduced_oracle(tgt, torch.arange(64))
    keep = _subset(nxt, 64, drop=4)
    draft, _, _ = reduced_oracle(tgt, keep)
    assert draft.lm_head.weight.shape == (len(keep), model.config.hidden_size)
    torch.testing.assert_close(draft.lm_head.weight, model.lm_head.weight[keep])
    eng = SpeculativeEngine(tgt, draft, parse_policy(policy, sps=SPS), SamplingParams(0.0))
    rep = eng.generate(PROMPTS, 40)
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in plain.outputs]
    single = eng.generate([PROMPTS[2]], 40)
    assert single.outputs[0].tokens == plain.outputs[2].tokens
    # every draft token is inside the subset; the target emitted tokens outside it
    emitted = {t for o in rep.outputs for t in o.tokens}
    assert emitted - set(keep.tolist()), "the test must make the target emit tokens the draft cannot"
    if policy == "static:4":
        assert rep.stats.histogram[4] > 0 and rep.stats.tau > 1.4


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)])
def test_sampled_output_matches_target_distribution_with_a_reduced_vocabulary(params):
    model = tiny_target("llama", vocab=8, hidden=32, seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    tgt = TargetAdapter(model, [0, 1])
    keep = torch.tensor([0, 2, 3, 5, 6])  # ids 1, 4, 7 have target mass but draft probability 0
    draft = random_draft(tgt, seed=5, block_size=3, markov_rank=4, layer_ids=[0, 1], draft_vocab_size=5)
    draft.set_draft_vocab(keep)
    draft.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.mul_(100.0)
    eng = SpeculativeEngine(tgt, draft, parse_policy("static:3"), params)
    prompt, n = [3, 5, 6], 6000
    rep = eng.generate([prompt] * n, 3, generator=torch.Generator().manual_seed(11))
    hist = rep.stats.histogram
    assert hist[0] > 300 and hist[1] > 300, hist
    second = torch.tensor([o.tokens[1] for o in rep.outputs])
    assert set(second.tolist()) - set(keep.tolist()), "tokens outside the subset must still be emitted"
    assert_three_tokens_distributed_as(rep.outputs, _exact_three_token_distribution(model, prompt, params), params)


def test_teacher_forced_beta_treats_missing_ids_as_zero_draft_mass():
    model = tiny_target("qwen3")
    tgt = TargetAdapter(model, [0, 1])
    keep = torch.arange(0, 64, 2)
    draft = random_draft(tgt, seed=2, block_size=3, markov_rank=8, layer_ids=[0, 1], draft_vocab_size=32)
    draft.set_draft_vocab(keep)
    draft.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())
    seq = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    with torch.no_grad():
        out = model(seq[None], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[1], out.hidden_states[2]], -1)[0]
    params = SamplingParams(1.0)
    betas = sequence_betas(draft, seq, feats, out.logits[0], 3, params)
    # by hand for anchor 3: q over the subset, spread on V
    hidden = draft.forward_blocks(feats[None], seq[None, 3:4], torch.tensor([[3]]))[0]
    logits, _ = draft.block_logits(hidden, seq[3:6][None])
    q = torch.zeros(1, 3, 64)
    q[..., keep] = torch.softmax(logits.float(), -1)
    p = warp_probs(out.logits[0, 3:6].float(), params)
    torch.testing.assert_close(betas[0], (1 - 0.5 * (p - q[0]).abs().sum(-1)), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ the file format
def _saved(tmp_path, keep=torch.arange(0, 64, 2)):
    tgt = TargetAdapter(tiny_target("llama"), [0, 1])
    draft = random_draft(tgt, seed=2, block_size=3, markov_rank=8, layer_ids=[0, 1], draft_vocab_size=len(keep))
    draft.set_draft_vocab(keep)
    draft.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())
    return tgt, draft, save_draft(draft, tmp_path / "d", dtype=torch.float32)


def test_round_trip_keeps_the_index_map_and_full_drafts_keep_deepspec_config(tmp_path):
    tgt, draft, folder = _saved(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 32
    tensors = load_file(str(folder / "model.safetensors"))
    assert tensors["draft_vocab_ids"].dtype == torch.int64
    assert tensors["markov_head.markov_w2.weight"].shape == (32, 8)
    back = load_draft(folder, tgt)
    assert torch.equal(back.draft_vocab_ids, draft.draft_vocab_ids)
    torch.testing.assert_close(back.lm_head.weight, tgt.lm_head().weight[draft.draft_vocab_ids])
    full = random_draft(tgt, seed=2, block_size=3, markov_rank=8, layer_ids=[0, 1])
    fcfg = json.loads((save_draft(full, tmp_path / "full") / "config.json").read_text())
    assert "draft_vocab_size" not in fcfg
    assert "draft_vocab_ids" not in load_file(str(tmp_path / "full" / "model.safetensors"))


def _corrupt(folder, ids=None, cfg_size=None):
    f = folder / "model.safetensors"
    t = load_file(str(f))
    if ids is not None:
        t["draft_vocab_ids"] = ids
    save_file(t, str(f))
    if cfg_size is not None:
        c = json.loads((folder / "config.json").read_text())
        c["draft_vocab_size"] = cfg_size
        (folder / "config.json").write_text(json.dumps(c))


BAD = [
    ("out of range", dict(ids=torch.arange(0, 64, 2) + 40), "outside the vocabulary"),
    ("negative", dict(ids=torch.cat([torch.tensor([-1]), torch.arange(2, 64, 2)])), "outside the vocabulary"),
    ("duplicate", dict(ids=torch.cat([torch.tensor([0, 0]), torch.arange(4, 64, 2)])), "strictly increasing"),
    ("unsorted", dict(ids=torch.arange(0, 64, 2).flip(0)), "strictly increasing"),
    ("float ids", dict(ids=torch.arange(0, 64, 2).float()), "int64"),
    ("size vs config", dict(cfg_size=30), "draft_vocab"),
    ("bigger than vocab", dict(cfg_size=100), "draft_vocab_size 100"),
]


@pytest.mark.parametrize("name,kw,message", BAD, ids=[b[0] for b in BAD])
def test_bad_index_maps_are_refused(tmp_path, name, kw, message):
    tgt, _, folder = _saved(tmp_path)
    _corrupt(folder, **kw)
    with pytest.raises(CheckpointError, match=message):
        load_draft(folder, tgt)


@pytest.mark.parametrize("name,kw,message", BAD[:3] + BAD[5:6], ids=[b[0] for b in BAD[:3] + BAD[5:6]])
def test_cli_refuses_bad_index_maps_in_one_line(tmp_path, name, kw, message):
    target = save_tiny_target(tmp_path / "target", "llama")
    model = tiny_target("llama")
    tgt = TargetAdapter(model, [0, 1])
    draft = random_draft(tgt, seed=2, block_size=3, markov_rank=8, layer_ids=[0, 1], draft_vocab_size=32)
    draft.set_draft_vocab(torch.arange(0, 64, 2))
    folder = save_draft(draft, tmp_path / "d")
    _corrupt(folder, **kw)
    trace = tmp_path / "t.jsonl"
    res = CliRunner().invoke(app, ["generate", "--target", str(target), "--draft", str(folder), "--max-new-tokens", "4",
                                   "--trace", str(trace), "w5 w6"])
    assert res.exit_code != 0
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output, res.output
    assert message.split()[0] in res.output
    assert not trace.exists()
