"""Engine: greedy speculative output == plain greedy output; sampled output is distributed as the target."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.errors import UsageError
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.sps import SPSTable
from dsparkctl.models.draft_io import random_draft
from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import bigram_oracle_draft, tiny_target

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17], [20]]
SPS = SPSTable([1, 2, 4, 8, 16, 32], [100.0, 99.0, 97.0, 90.0, 80.0, 60.0])


def _engine(family, policy, oracle, stop=(), block_size=4, **defaults):
    model = tiny_target(family)
    tgt = TargetAdapter(model, [0, 1])
    if oracle:
        draft = bigram_oracle_draft(tgt, PROMPTS, block_size=block_size, layer_ids=[0, 1])
    else:
        draft = random_draft(tgt, seed=3, block_size=block_size, markov_rank=8, layer_ids=[0, 1])
    eng = SpeculativeEngine(tgt, draft, parse_policy(policy, sps=SPS), SamplingParams(0.0), stop_token_ids=stop,
                            **defaults)
    return model, eng


# what `generate` runs by default: the dspark gate, siblings priced by the table, context lookup
DEFAULTS = {"policy": "dspark", "siblings": "auto", "lookup": True}
CONFIGS = pytest.mark.parametrize("config", [{"policy": "static:4"}, DEFAULTS], ids=["static4", "defaults"])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("policy,oracle", [("static:0", False), ("static:1", True), ("static:2", True),
                                           ("static:4", True), ("static:4", False), ("dspark", True),
                                           ("dspark-async", True), ("threshold:0.3", True)])
def test_greedy_identity_batched_and_single(family, policy, oracle):
    model, eng = _engine(family, policy, oracle)
    base = plain_generate(TargetAdapter(model), PROMPTS, 40, SamplingParams(0.0))
    rep = eng.generate(PROMPTS, 40)
    for i, (a, b) in enumerate(zip(rep.outputs, base.outputs)):
        assert a.tokens == b.tokens, f"ragged batch: request {i} differs"
        assert len(a.tokens) == 40
    single = eng.generate([PROMPTS[2]], 40)
    assert single.outputs[0].tokens == base.outputs[2].tokens
    if oracle and policy == "static:4":
        # the oracle draft must exercise multi-token acceptance, partial acceptance and rejection
        hist = rep.stats.histogram
        assert hist[4] > 0 and sum(hist[1:4]) > 0 and rep.stats.tau > 1.4, hist


def _proposers(eng):
    """Spy on `eng.round`: the proposers each round used (draft chain, copied block, sibling taken)."""
    seen = {"draft": 0, "lookup": 0, "sibling": 0, "plain": 0}
    real = eng.round

    def spy(*a):
        rd = real(*a)
        if not rd.drafted:
            seen["plain"] += int(rd.accepted.numel())
        else:
            seen["lookup"] += int(rd.copied().sum())
            seen["draft"] += int((~rd.copied()).sum())
            seen["sibling"] += int(rd.took_sibling().sum())
        return rd
    eng.round = spy
    return seen


REPEATING = [[5, 6, 7, 5, 6, 7, 5, 6], [3, 4], [10, 11, 12, 10, 11, 12, 13, 10, 11], [20, 21, 20, 21]]


@CONFIGS
@pytest.mark.parametrize("at", [3, 7])
def test_eos_mid_block_stops_exactly_where_plain_decoding_stops(config, at):
    """A stop token inside an accepted block, a copied block or a taken sibling ends the request
    exactly where plain decoding ends it; under the defaults every proposer took part."""
    policy = config["policy"]
    extra = {k: v for k, v in config.items() if k != "policy"}
    prompts = REPEATING if extra else PROMPTS
    model, eng = _engine("llama", policy, not extra, **extra)
    base = plain_generate(TargetAdapter(model), prompts, 40, SamplingParams(0.0))
    # pick a token that plain decoding emits mid-way in request 0 as the stop token
    stop = base.outputs[0].tokens[at]
    _, eng = _engine("llama", policy, not extra, stop=(stop,), **extra)
    seen = _proposers(eng)
    ref = plain_generate(TargetAdapter(model), prompts, 40, SamplingParams(0.0), stop_token_ids=(stop,))
    rep = eng.generate(prompts, 40)
    for a, b in zip(rep.outputs, ref.outputs):
        assert a.tokens == b.tokens
        assert a.finish_reason == b.finish_reason
    assert rep.outputs[0].finish_reason == "stop" and rep.outputs[0].tokens[-1] == stop
    assert len(rep.outputs[0].tokens) <= at + 1
    if extra:
        assert seen["draft"] > 0 and seen["lookup"] > 0 and seen["sibling"] > 0, seen


@CONFIGS
@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_budget_is_exact(config, max_new):
    policy = config["policy"]
    extra = {k: v for k, v in config.items() if k != "policy"}
    prompts = REPEATING if extra else PROMPTS
    model, eng = _engine("qwen3", policy, not extra, **extra)
    seen = _proposers(eng)
    rep = eng.generate(prompts, max_new)
    base = plain_generate(TargetAdapter(model), prompts, max_new, SamplingParams(0.0))
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in base.outputs]
    assert all(len(o.tokens) == max_new for o in rep.outputs)
    if extra and max_new == 13:
        assert seen["lookup"] > 0 and seen["draft"] > 0, seen


def test_static_k_beyond_block_size_is_refused():
    with pytest.raises(UsageError, match="block size"):
        _engine("llama", "static:9", False)


def _exact_three_token_distribution(model, prompt, params):
    """Enumerate P(y1, y2, y3 | prompt) under the warped target, exactly.  -> [V, V, V]"""
    from dsparkctl.math.sampling import warp_probs
    with torch.no_grad():
        p1 = warp_probs(model(torch.tensor([prompt])).logits[0, -1], params)  # [V]
        V = p1.shape[0]
        s2 = torch.tensor([prompt + [a] for a in range(V)])
        p2 = warp_probs(model(s2).logits[:, -1], params)  # [V, V]
        s3 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = warp_probs(model(s3).logits[:, -1], params).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def assert_three_tokens_distributed_as(outputs, exact: torch.Tensor, params) -> None:
    """The first three tokens of `outputs` (samples for one prompt) against the exact law `exact` [V, V, V]:
    token 1, and tokens 2-3 jointly, by chi-square (cells expecting ≤ 5 counts only bounded, not tested)."""
    exact, n, V = exact.double(), len(outputs), exact.shape[0]
    for name, obs_idx, exp in (
        ("token 1", [o.tokens[0] for o in outputs], exact.sum((1, 2))),
        ("tokens 2-3", [o.tokens[1] * V + o.tokens[2] for o in outputs], exact.sum(0).flatten()),
    ):
        obs = torch.bincount(torch.tensor(obs_idx), minlength=exp.numel()).double()
        e = exp * n
        keep = e > 5
        assert obs[~keep].sum() <= max(20.0, 3 * float(e[~keep].sum())), name
        o, ek = obs[keep], e[keep]
        stat, pval = chisquare(o.numpy(), (ek * o.sum() / ek.sum()).numpy())
        print(f"{params}: {name} chi2={stat:.1f} p={pval:.3f}")
        assert pval > 1e-3, (name, stat, pval)


@pytest.mark.slow  # ~4 s each
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)])
def test_sampled_output_matches_target_distribution(params):
    """End to end through the engine. Token 1 comes from prefill; tokens 2-3 come from a
    speculative round (ℓ = 1 under a 3-token budget: accepted draft or residual, then bonus).
    Their joint law must be the target's, marginalised over token 1."""
    torch.manual_seed(0)
    model = tiny_target("llama", vocab=8, hidden=32, seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # soften: many tokens have mass
    tgt = TargetAdapter(model, [0, 1])
    draft = random_draft(tgt, seed=5, block_size=3, markov_rank=4, layer_ids=[0, 1])
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.mul_(100.0)  # a confident, often wrong draft
    eng = SpeculativeEngine(tgt, draft, parse_policy("static:3"), params)
    prompt = [3, 5, 6]
    n = 6000
    gen = torch.Generator().manual_seed(11)
    rep = eng.generate([prompt] * n, 3, generator=gen)
    hist = rep.stats.histogram
    assert hist[0] > 300 and hist[1] > 300, hist  # both rejections and acceptances happened
    assert_three_tokens_distributed_as(rep.outputs, _exact_three_token_distribution(model, prompt, params), params)


@pytest.mark.slow  # ~3.4 s
def test_bf16_path_runs_and_stays_greedy_exact():
    """--dtype bf16: draft and target in bf16, verification in fp32 probabilities."""
    model = tiny_target("qwen3").to(torch.bfloat16)
    tgt = TargetAdapter(model, [0, 1])
    draft = bigram_oracle_draft(tgt, PROMPTS, layer_ids=[0, 1])
    assert next(draft.fc.parameters()).dtype == torch.bfloat16
    rep = SpeculativeEngine(tgt, draft, parse_policy("static:4"), SamplingParams(0.0)).generate(PROMPTS, 30)
    base = plain_generate(TargetAdapter(model), PROMPTS, 30, SamplingParams(0.0))
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in base.outputs]
    sampled = SpeculativeEngine(tgt, draft, parse_policy("static:4"), SamplingParams(1.0))
    out = sampled.generate(PROMPTS, 30, generator=torch.Generator().manual_seed(0))
    assert all(len(o.tokens) == 30 for o in out.outputs)


def _grid_table(plain_share: float) -> SPSTable:
    """A table that prices the plain step at `plain_share` of a drafted step verifying nothing."""
    from dsparkctl.math.sps import StepGrid

    reqs, toks = [1, 2, 4, 8], [1, 2, 3, 4, 5]
    ms = [[10.0 * (1 + 0.05 * r) * (1 + 0.1 * (t - 1)) for t in toks] for r in reqs]
    grid = StepGrid(reqs, toks, ms, [plain_share * row[0] for row in ms])
    return SPSTable(SPS.batch_tokens, SPS.steps_per_sec, grid=grid)


@pytest.mark.parametrize("policy", ["dspark", "dspark-async", "static:0"])
@pytest.mark.parametrize("plain_share", [0.2, 0.75])
def test_skipping_the_draft_keeps_greedy_identity(policy, plain_share):
    """The skip-the-draft path (a plain step chosen before drafting, deferred draft context)
    must leave greedy output token for token equal to plain decoding, batched and alone."""
    model = tiny_target("llama")
    tgt = TargetAdapter(model, [0, 1])
    draft = bigram_oracle_draft(tgt, PROMPTS, block_size=4, layer_ids=[0, 1])
    eng = SpeculativeEngine(tgt, draft, parse_policy(policy, sps=_grid_table(plain_share)), SamplingParams(0.0))
    base = plain_generate(TargetAdapter(model), PROMPTS, 40, SamplingParams(0.0))
    rows = []
    rep = eng.generate(PROMPTS, 40, on_round=rows.extend)
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in base.outputs]
    assert eng.generate([PROMPTS[1]], 40).outputs[0].tokens == base.outputs[1].tokens
    drafted = [r.drafted for r in rows]
    assert all(r.verify_length == 0 and r.confidence_logits is None for r in rows if not r.drafted)
    if policy == "static:0":
        assert not any(drafted)
    elif plain_share < 0.5:
        assert not all(drafted) and any(drafted), drafted  # both paths ran (probes while skipping)


@pytest.mark.parametrize("policy", ["static:0", "dspark-async"])
def test_sampled_output_with_skipped_drafts_matches_target_distribution(policy):
    """Sampling through plain steps the policy chose (static:0 always; dspark-async after its
    estimate says drafting cannot pay) follows the target's law."""
    params = SamplingParams(1.0)
    model = tiny_target("llama", vocab=8, hidden=32, seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    tgt = TargetAdapter(model, [0, 1])
    draft = random_draft(tgt, seed=5, block_size=3, markov_rank=4, layer_ids=[0, 1])
    from dsparkctl.math.sps import StepGrid

    grid = StepGrid([1, 4096], [1, 2, 3, 4], [[10.0, 11.0, 12.0, 13.0], [20.0, 30.0, 40.0, 50.0]], [0.5, 1.0])
    pol = parse_policy(policy, sps=SPSTable([1, 2], [1.0, 0.9], grid=grid))
    eng = SpeculativeEngine(tgt, draft, pol, params)
    prompt = [3, 5, 6]
    gen = torch.Generator().manual_seed(12)
    rows = []
    # 4 tokens: prefill, a drafted round (no estimate yet) or a plain step, then plain steps
    rep = eng.generate([prompt] * 4000, 4, generator=gen, on_round=rows.extend)
    assert any(not r.drafted for r in rows)
    assert_three_tokens_distributed_as(rep.outputs, _exact_three_token_distribution(model, prompt, params), params)


@pytest.mark.slow  # ~6 s
@pytest.mark.parametrize("plain_ms", [5.0, 1.0], ids=["gate-open", "gate-closing"])
def test_the_default_gate_samples_the_targets_law(plain_ms):
    """`generate`'s default policy (dspark: Algorithm 1 on the confidence head's survivals, and its
    skip gate) under sampling, through the engine: the first three tokens follow the target's law
    by chi-square. The tables make drafting pay at every batch size (gate open: ℓ chosen per row
    from the confidences) or not at this one once the gate has an estimate (it closes: the first
    round drafts, the later ones are plain steps), 5000 rows in one batch, 4 tokens each."""
    params = SamplingParams(1.0)
    model = tiny_target("llama", vocab=8, hidden=32, seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    tgt = TargetAdapter(model, [0, 1])
    draft = random_draft(tgt, seed=5, block_size=3, markov_rank=4, layer_ids=[0, 1], confidence=True)
    from dsparkctl.math.sps import StepGrid

    grid = StepGrid([1, 8192], [1, 2, 3, 4], [[10.0, 10.2, 10.4, 10.6], [10.0, 10.2, 10.4, 10.6]],
                    [plain_ms, plain_ms])
    eng = SpeculativeEngine(tgt, draft, parse_policy("dspark", sps=SPSTable([1, 2], [1.0, 0.99], grid=grid)), params,
                            siblings="auto", lookup=True)  # both off under sampling, as generate leaves them
    assert eng.effective_siblings == 0 and not eng.lookup
    prompt = [3, 5, 6]
    rows = []
    rep = eng.generate([prompt] * 5000, 4, generator=torch.Generator().manual_seed(13), on_round=rows.extend)
    drafted = [r for r in rows if r.drafted]
    print({"drafted": len(drafted), "plain": len(rows) - len(drafted),
           "lengths": sorted({r.verify_length for r in drafted})})
    assert drafted and any(not r.drafted for r in rows) == (plain_ms < 2)
    if plain_ms > 2:
        assert len({r.verify_length for r in drafted}) >= 2, "the policy must choose lengths, not one"
    hist = rep.stats.histogram
    assert hist[0] > 100 and sum(hist[1:]) > 100, hist  # rejections and acceptances both
    assert_three_tokens_distributed_as(rep.outputs, _exact_three_token_distribution(model, prompt, params), params)

