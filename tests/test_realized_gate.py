"""The skip gate corrected by realized acceptance: hand values, the gate's decisions, its lag,
and the engine telling the policy what each drafted step brought."""

from __future__ import annotations

import pytest
import torch

from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.realized import PSEUDO, Realized
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.sps import SPSTable, StepGrid
from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import bigram_oracle_draft, tiny_target


def _table(plain_share: float = 0.75) -> SPSTable:
    reqs, toks = [1, 2, 4, 8], [1, 2, 3, 4, 5]
    ms = [[10.0 * (1 + 0.05 * r) * (1 + 0.1 * (t - 1)) for t in toks] for r in reqs]
    grid = StepGrid(reqs, toks, ms, [plain_share * row[0] for row in ms])
    return SPSTable([1, 2, 4, 8, 16, 32], [100.0, 99.0, 97.0, 90.0, 80.0, 60.0], grid=grid)


def test_realized_ratio_on_hand_values():
    r = Realized.empty(3)
    # two rows, predicted survivals; row 0 verified 2 slots and accepted 1, row 1 verified 1 and accepted 1
    r.add(torch.tensor([[0.8, 0.6, 0.3], [0.5, 0.4, 0.2]]), torch.tensor([2, 1]), torch.tensor([1, 1]))
    assert r.seen.tolist() == pytest.approx([1.3, 0.6, 0.0])
    assert r.hit.tolist() == pytest.approx([2.0, 0.0, 0.0])
    rho1 = (2.0 + PSEUDO) / (1.3 + PSEUDO)
    rho2 = (0.0 + PSEUDO * rho1) / (0.6 + PSEUDO)
    assert r.ratio().tolist() == pytest.approx([rho1, rho2, rho2])  # nothing seen at 3: its neighbour's ratio
    fixed = r.correct(torch.tensor([0.9, 0.5, 0.45]))
    assert fixed.tolist() == pytest.approx([1.0, 0.5 * rho2, 0.45 * rho2])  # clipped at 1
    assert bool((fixed[1:] <= fixed[:-1]).all())
    assert Realized.empty(2).ratio().tolist() == [1.0, 1.0]  # no evidence: the prediction stands


@pytest.mark.parametrize("policy", ["dspark", "dspark-async"])
def test_the_gate_closes_when_drafts_bring_less_than_their_confidences_say(policy):
    """Confident drafts that verification rejects every time close the gate within a few steps;
    the same confidences borne out keep it open."""
    conf = torch.full((4, 4), 4.0)  # survivals ≈ 0.98, 0.96, 0.95, 0.93: drafting pays on paper

    def run(accept_all: bool) -> list[bool]:
        pol = parse_policy(policy, sps=_table())
        plans = []
        for _ in range(30):
            plans.append(pol.plan(4))
            if plans[-1]:
                ell = pol.choose(conf)
                pol.observe(ell, ell if accept_all else torch.zeros_like(ell))
        return plans

    kept, rejected = run(True), run(False)
    assert all(kept)
    # dspark closes after its first step; dspark-async reads each step two steps later and verifies
    # one draft per request before it has an estimate, so it takes four. Then probes after 8, 16
    # skipped steps (FIRST_PROBE_GAP, doubling).
    closed = {"dspark": [0, 9, 26], "dspark-async": [0, 1, 2, 3, 12, 29]}[policy]
    assert [i for i, d in enumerate(rejected) if d] == closed, rejected


def test_dspark_async_reads_an_observation_two_steps_later():
    pol = parse_policy("dspark-async", sps=_table())
    conf = torch.full((4, 4), 4.0)
    assert pol.plan(4)
    ell = pol.choose(conf)
    pol.observe(ell, torch.zeros_like(ell))
    assert pol.plan(4) and pol.state.realized is None  # one step later: an async engine does not know it yet
    pol.choose(conf)  # (not observed: the engine may not have verified it yet when the next is planned)
    pol.plan(4)
    assert pol.state.realized is not None and float(pol.state.realized.hit.sum()) == 0.0
    assert float(pol.state.realized.seen[0]) == pytest.approx(4 * torch.sigmoid(torch.tensor(4.0)).item(), rel=1e-6)


def test_the_engine_tells_the_policy_what_each_drafted_step_brought():
    """observe gets each drafted round's verify lengths and accepted drafts, in the round's rows;
    greedy output stays the target's own."""
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17], [20]]
    model = tiny_target("llama")
    tgt = TargetAdapter(model, [0, 1])
    draft = bigram_oracle_draft(tgt, prompts, block_size=4, layer_ids=[0, 1])
    pol = parse_policy("dspark", sps=_table(0.2))
    seen = []
    original = pol.observe
    pol.observe = lambda lengths, accepted, state=None: (seen.append((lengths.tolist(), accepted.tolist())),
                                                         original(lengths, accepted, state))
    rounds = []
    eng = SpeculativeEngine(tgt, draft, pol, SamplingParams(0.0))
    rep = eng.generate(prompts, 40, on_round=rounds.append)
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in plain_generate(tgt, prompts, 40,
                                                                                SamplingParams(0.0)).outputs]
    drafted = [rs for rs in rounds if rs[0].drafted]
    assert len(seen) == len(drafted) > 0
    for (lengths, accepted), rs in zip(seen, drafted):
        assert lengths == [r.verify_length for r in rs] and accepted == [r.accepted for r in rs]
    assert pol.state.realized is not None


@pytest.mark.parametrize("policy", ["dspark", "dspark-async"])
def test_an_over_confident_draft_is_gated_by_what_it_brings_and_stays_lossless(policy, monkeypatch):
    """An audit setting whose confidences sit 3 logits above the truth: with the realized
    correction the gate drafts in few steps, without it in nearly all; the output follows the
    target's law (chi-square) either way."""
    from dsparkctl.math.audit import audit_policy, over_confident, random_setting, with_plain_step

    s = over_confident(with_plain_step(random_setting(torch.Generator().manual_seed(2), R=3), 0))

    def audit():
        return audit_policy(s, parse_policy(policy, sps=s.sps), 20_000, torch.Generator().manual_seed(1))
    corrected = audit()
    monkeypatch.setattr(Realized, "correct", lambda self, profile: profile.double())
    predicted_only = audit()
    assert corrected.passed and predicted_only.passed, (corrected, predicted_only)
    assert corrected.drafted_share < 0.3 and predicted_only.drafted_share > 0.9, (corrected, predicted_only)
