"""Siblings of x1 (engine/siblings.py): the tree feed scores each sibling as its own chain would,
greedy output stays identical to plain decoding, and the pieces (rescue, kept slots, count) do
what they say."""

from __future__ import annotations

import pytest
import torch

from dsparkctl.engine import siblings as sib
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.errors import UsageError
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.sps import SPSTable
from dsparkctl.math.verify import VerifyResult
from dsparkctl.models.draft_io import random_draft
from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import bigram_oracle_draft, tiny_target

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17], [20]]
FLAT = SPSTable([1, 2, 4, 8, 16, 32, 64], [100.0] * 7)  # extra tokens cost nothing: siblings always pay


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_feed_scores_each_sibling_as_its_own_chain(family):
    model = tiny_target(family)
    prompts = [[5, 6, 7, 8, 9], [3, 4, 11]]
    tree = TargetAdapter(model, [0, 1])
    tree.prefill(prompts)
    x = torch.tensor([[21, 22, 23], [31, 32, 33]])  # x0 x1 x2 per row; row 1 verifies one draft only
    ell = torch.tensor([2, 1])
    feed = sib.sibling_feed(torch.tensor([[40, 41], [42, 43]]), ell, 2)
    valid = torch.arange(3)[None, :] < (ell + 1)[:, None]
    out = tree.extend(torch.cat([x, feed.tokens], 1), ell + 1,
                      tree=lambda cached, seq_len: sib.tree_layout(feed, valid, cached, seq_len))
    for r, p in enumerate(prompts):
        for j in range(2):  # sibling j alone after x0: the chain [x0, s_j]
            chain = TargetAdapter(model, [0, 1])
            chain.prefill([p])
            ref = chain.extend(torch.tensor([[int(x[r, 0]), int(feed.tokens[r, j])]]), torch.tensor([2]))
            torch.testing.assert_close(out.logits[r, 3 + j], ref.logits[0, 1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.features[r, 3 + j], ref.features[0, 1], atol=1e-5, rtol=1e-5)
        chain = TargetAdapter(model, [0, 1])
        chain.prefill([p])  # and the chain's own slots as a plain verify scores them
        n = int(ell[r]) + 1
        ref = chain.extend(x[r: r + 1, :n], torch.tensor([n]))
        torch.testing.assert_close(out.logits[r, :n], ref.logits[0], atol=1e-5, rtol=1e-5)


def test_a_kept_sibling_leaves_the_cache_as_its_chain_would():
    """Take sibling 1 (it moves to x1's column), commit x0 and it, then decode on: the next forward
    sees exactly [prompt, x0, s1], and the cache holds no holes."""
    model = tiny_target("llama")
    p = [5, 6, 7, 8, 9]
    a, b = TargetAdapter(model, [0, 1]), TargetAdapter(model, [0, 1])
    a.prefill([p])
    ell = torch.tensor([3])
    feed = sib.sibling_feed(torch.tensor([[40, 41]]), ell, 2)
    valid = torch.ones(1, 4, dtype=torch.bool)
    a.extend(torch.tensor([[21, 22, 23, 24, 40, 41]]), ell + 1,
             tree=lambda cached, seq_len: sib.tree_layout(feed, valid, cached, seq_len))
    rows, cols = sib.taken_columns(torch.tensor([1]), feed)
    assert rows.tolist() == [0] and cols.tolist() == [5]
    a.relocate(rows, cols, torch.ones_like(cols))
    a.commit(torch.tensor([2]))
    assert int(a.seq_len[0]) == len(p) + 2 and a.cache_slots() == len(p) + 2 and bool(a.valid.all())
    b.prefill([p + [21, 41]])
    got = a.extend(torch.tensor([[50]]), torch.tensor([1]))
    ref = b.extend(torch.tensor([[50]]), torch.tensor([1]))
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)


def _engine(family, oracle, siblings, policy="static:3", table=FLAT):
    model = tiny_target(family)
    tgt = TargetAdapter(model, [0, 1])
    draft = (bigram_oracle_draft(tgt, PROMPTS, block_size=4, layer_ids=[0, 1]) if oracle else
             random_draft(tgt, seed=3, block_size=4, markov_rank=8, layer_ids=[0, 1]))
    return model, SpeculativeEngine(tgt, draft, parse_policy(policy, sps=table), SamplingParams(0.0),
                                    siblings=siblings)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("oracle,siblings,policy", [(False, 3, "static:3"), (True, 2, "static:2"),
                                                     (False, "auto", "dspark"), (True, "auto", "dspark"),
                                                     (False, 16, "static:1")])
def test_greedy_identity_with_siblings(family, oracle, siblings, policy, monkeypatch):
    monkeypatch.setattr(sib, "RESOLUTION", 0.0)  # FLAT prices every sibling free: auto then always takes some
    model, eng = _engine(family, oracle, siblings, policy)
    base = plain_generate(TargetAdapter(model), PROMPTS, 40, SamplingParams(0.0))
    rep = eng.generate(PROMPTS, 40)
    for i, (a, b) in enumerate(zip(rep.outputs, base.outputs)):
        assert a.tokens == b.tokens, f"request {i} differs"
    single = eng.generate([PROMPTS[2]], 40)
    assert single.outputs[0].tokens == base.outputs[2].tokens
    st = rep.streams
    assert st.sibling_rows > 0 and st.siblings_verified >= st.sibling_rows  # siblings were verified
    # the engine's τ counts every emitted token: its rounds' tokens add up to what was generated after the prefill's
    assert st.speculative_tokens + st.plain_rows == sum(len(o.tokens) - 1 for o in rep.outputs)
    # the draft's own stream counts its chain alone: a taken sibling is none of its accepted drafts
    assert st.draft.tokens == st.speculative_tokens - st.sibling_taken - st.lookup.tokens
    assert st.sibling_taken <= st.sibling_chances <= st.sibling_rows
    if not oracle:  # a random draft misses x1 often: its runners-up must have been taken somewhere
        assert st.sibling_taken > 0, st


def test_siblings_off_or_refused_when_sampling():
    model = tiny_target("llama")
    tgt = TargetAdapter(model, [0, 1])
    draft = random_draft(tgt, seed=3, block_size=4, markov_rank=8, layer_ids=[0, 1])
    hot = SamplingParams(0.8)
    with pytest.raises(UsageError, match="only greedy"):
        SpeculativeEngine(tgt, draft, parse_policy("static:2"), hot, siblings=2)
    eng = SpeculativeEngine(tgt, draft, parse_policy("dspark", sps=FLAT), hot, siblings="auto")
    rep = eng.generate(PROMPTS[:2], 12, generator=torch.Generator().manual_seed(0))
    assert rep.streams.sibling_rows == 0
    # auto without a table to price them proposes none; 0 proposes none
    for s, pol in (("auto", "static:2"), (0, "static:2")):
        e = SpeculativeEngine(tgt, draft, parse_policy(pol), SamplingParams(0.0), siblings=s)
        assert e._proposed_siblings() == 0 and e.generate(PROMPTS[:1], 8).streams.sibling_rows == 0


@pytest.mark.parametrize("bad", ["many", "-1", "17", "2.5"])
def test_parse_siblings_refuses_nonsense(bad):
    with pytest.raises(UsageError):
        sib.parse_siblings(bad)


def test_parse_siblings():
    assert sib.parse_siblings(None) == sib.parse_siblings(" Auto ") == sib.AUTO
    assert sib.parse_siblings("0", greedy=False) == 0 and sib.parse_siblings(3) == 3


def test_rescue_takes_the_sibling_the_target_chose():
    V = 10
    logits = torch.zeros(3, 5, V)  # chain columns 0..2, siblings 3..4
    feed = sib.SiblingFeed(tokens=torch.tensor([[4, 5], [4, 5], [4, 5]]), valid=torch.tensor([[1, 1], [1, 1], [0, 0]]).bool(),
                           chain=3)
    logits[:, 0, 5] = 1.0  # every row's target token after x0 is 5: sibling 1
    logits[:, 4, 7] = 1.0  # and after sibling 1 the target says 7
    res = VerifyResult(accepted=torch.tensor([0, 2, 0]), emitted=torch.tensor([[5, -1, -1], [1, 2, 3], [5, -1, -1]]),
                       num_emitted=torch.tensor([1, 3, 1]))
    out, taken = sib.rescue(res, logits, feed)
    assert taken.tolist() == [1, -1, -1]  # row 1 kept its chain; row 2 had no siblings
    assert out.accepted.tolist() == [1, 2, 0] and out.num_emitted.tolist() == [2, 3, 1]
    assert out.emitted[0, :2].tolist() == [5, 7] and out.emitted[1].tolist() == [1, 2, 3]
    rows, cols = sib.taken_columns(taken, feed)
    assert rows.tolist() == [0] and cols.tolist() == [4]


def test_plan_prices_chain_and_siblings_with_the_table():
    surv = torch.tensor([[0.4, 0.25, 0.1]])
    q = torch.tensor([[0.5, 0.2, 0.1, 0.01]])
    ell = torch.tensor([2])
    wide = SPSTable([1, 2, 4, 8, 16], [100.0] * 5)  # no grid: 16 tokens measured at one request
    assert sib.plan(surv, ell, q, wide, 3) == (2, 2)  # free tokens: the chain and the siblings that bring
    # more than the table resolves (the third's 0.01 of ~2 tokens does not)
    assert sib.plan(surv, ell, q, SPSTable([1, 2, 3, 4], [100.0] * 4), 3) == (2, 1)  # 4 tokens measured: 1 + 2 + 1
    steep = SPSTable([1, 2, 3, 4, 5, 6], [100.0, 90.0, 80.0, 40.0, 20.0, 10.0])
    assert sib.plan(surv, ell, q, steep, 3) == (2, 0)  # a fourth token halves the step rate: none pays
    gentle = SPSTable([1, 2, 3, 4, 5, 6], [100.0, 99.0, 98.0, 97.0, 96.0, 60.0])
    assert sib.plan(surv, ell, q, gentle, 3) == (2, 2)  # the third sibling, 1% at a 35% dearer step, does not
    # a chain whose second draft is unlikely gives its slot to a sibling that is likelier
    short = SPSTable([1, 2, 3, 4], [100.0, 99.0, 98.0, 60.0])
    assert sib.plan(torch.tensor([[0.4, 0.02, 0.01]]), ell, q, short, 3) == (1, 1)
    assert sib.plan(surv, torch.tensor([0]), q, FLAT, 3) == (0, 0)  # nothing verified: no siblings
    # within the table's resolution of the best, the narrowest step: 1% more tokens for 4 more is no choice
    assert sib.plan(surv, ell, torch.tensor([[0.5, 0.01, 0.005, 0.001]]), wide, 3) == (2, 0)


def test_sibling_rate_learns_what_runners_up_bring():
    rate = sib.SiblingRate()
    assert rate.scale == sib.PRIOR_SCALE
    feed = sib.SiblingFeed(tokens=torch.tensor([[4, 5]]), valid=torch.tensor([[True, True]]), chain=3)
    q = torch.tensor([[0.5, 0.3, 0.2]])
    for _ in range(40):  # promised 0.5 a round, never taken
        rate.add(q, feed, torch.tensor([-1]))
    assert rate.scale < 0.1
    surv, ell = torch.tensor([[0.4, 0.25, 0.1]]), torch.tensor([2])
    dearer = SPSTable([1, 2, 3, 4, 5, 6], [100.0, 100.0, 100.0, 97.0, 94.0, 91.0])  # 3% a token past 3
    assert sib.plan(surv, ell, q, dearer, 2) == (2, 2)
    assert sib.plan(surv, ell, q, dearer, 2, scale=rate.scale) == (2, 0)  # what they never brought is not priced in
    for _ in range(80):  # now taken every round
        rate.add(q, feed, torch.tensor([0]))
    assert rate.scale > 1.0


@pytest.mark.parametrize("kw", [{"markov_head_type": "gated"}, {"draft_vocab_size": 24},
                                {"markov_rank": 0, "confidence": False}])
def test_siblings_with_other_heads_and_a_reduced_vocabulary(kw):
    """The general Markov loop, a reduced draft vocabulary (runners-up mapped to target ids) and a
    DFlash draft (no Markov head) all propose siblings, and output stays the target's."""
    model = tiny_target("qwen3")
    tgt = TargetAdapter(model, [0, 1])
    draft = random_draft(tgt, seed=5, block_size=4, layer_ids=[0, 1], **{"markov_rank": 8, **kw})
    eng = SpeculativeEngine(tgt, draft, parse_policy("static:2"), SamplingParams(0.0), siblings=2)
    rep = eng.generate(PROMPTS, 32)
    base = plain_generate(TargetAdapter(model), PROMPTS, 32, SamplingParams(0.0))
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in base.outputs]
    assert rep.streams.sibling_rows > 0
    prop = draft.propose(eng.draft.new_state(1, "cpu", torch.float32), torch.tensor([5]), SamplingParams(0.0), None,
                         need_probs=False, alternatives=3)
    alts = prop.block.alternatives
    assert alts.shape == (1, 3) and len(set(alts[0].tolist()) | {int(prop.block.tokens[0, 0])}) == 4
    if draft.draft_vocab_ids is not None:
        assert set(alts[0].tolist()) <= set(draft.draft_vocab_ids.tolist())
    assert prop.block.first_probs.shape == (1, 4) and bool((prop.block.first_probs[0, :-1] >= prop.block.first_probs[0, 1:]).all())


def test_plan_keeps_the_policys_chain_when_no_sibling_pays():
    # five flat-priced widths: the table cannot tell a 3-draft chain from a 5-draft one, yet without a
    # sibling to make room for, the policy's 5 drafts stand
    flat6 = SPSTable([1, 2, 3, 4, 5, 6], [100.0] * 6)
    surv = torch.tensor([[0.4, 0.01, 0.005, 0.001, 0.0005]])
    assert sib.plan(surv, torch.tensor([5]), torch.tensor([[0.9, 0.001, 0.001]]), flat6, 2) == (5, 0)


def test_an_eager_target_keeps_its_chain():
    """Eager attention adds a mask to its scores: a boolean tree mask would mask nothing there."""
    model = tiny_target("llama")
    model.set_attn_implementation("eager")
    tgt = TargetAdapter(model, [0, 1])
    assert not tgt.takes_trees
    draft = random_draft(tgt, seed=3, block_size=4, markov_rank=8, layer_ids=[0, 1])
    with pytest.raises(UsageError, match="SDPA"):
        SpeculativeEngine(tgt, draft, parse_policy("static:2"), SamplingParams(0.0), siblings=2)
    eng = SpeculativeEngine(tgt, draft, parse_policy("dspark", sps=FLAT), SamplingParams(0.0), siblings="auto")
    rep = eng.generate(PROMPTS[:2], 16)
    assert rep.streams.sibling_rows == 0
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in plain_generate(TargetAdapter(model), PROMPTS[:2], 16,
                                                                                SamplingParams(0.0)).outputs]


def test_the_gate_counts_a_taken_sibling_as_what_the_round_brought():
    """A row that took a sibling emitted two tokens, as if x1 had been accepted: the skip gate's
    realized acceptance must see position 1 accepted there, else siblings talk it into plain steps."""
    _, eng = _engine("llama", False, 3, "static:3")
    seen: list[tuple[list[int], list[int]]] = []
    orig = eng.policy.observe
    eng.policy.observe = lambda ell, acc, state=None: (seen.append((ell.tolist(), acc.tolist())), orig(ell, acc, state))
    taken: list[list[int]] = []
    orig_commit = eng.commit

    def commit(live, res, out, feed=None, took=None):
        taken.append([-1] * res.accepted.numel() if took is None else took.tolist())
        return orig_commit(live, res, out, feed, took)
    eng.commit = commit
    eng.generate(PROMPTS, 30)
    rows = [(ell, acc, t) for (ells, accs), ts in zip(seen, taken) for ell, acc, t in zip(ells, accs, ts) if t >= 0]
    assert rows, "no sibling was taken: the test needs a draft that misses x1"
    assert all(acc == 1 and ell >= 1 for ell, acc, _ in rows), rows
