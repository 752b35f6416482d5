"""Context lookup (engine/lookup.py): the copied block on hand-made histories, greedy output
identical to plain decoding with lookup blocks accepted and rejected, rewinding, the
teacher-forced score, and the CLI's switch."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.engine.lookup import History, continuation, lookup_betas
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.sps import SPSTable
from dsparkctl.models.draft_io import random_draft
from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import tiny_target

T = torch.tensor


@pytest.mark.parametrize("hist,gamma,want", [
    ([1, 2, 3, 9, 9, 1, 2, 3], 4, [9, 9, 1, 2]),  # the 3-token suffix seen before: what followed it
    ([2, 3, 7, 2, 3, 8, 5, 2, 3], 2, [8, 5]),  # the latest occurrence wins
    ([5, 6, 4, 6, 9, 5, 6], 3, [4, 6, 9]),  # only 2 tokens match
    ([4, 4, 4], 3, [4, 4, 4]),  # a copy reaching past the anchor repeats itself (period 1)
    ([1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),  # period 2
    ([1, 2, 3, 4], 3, None),  # nothing repeats
    ([7, 1, 2, 7], 2, None),  # a single repeated token is not enough
    ([3, 3], 2, None),  # the suffix itself is not an earlier occurrence
])
def test_continuation_copies_what_followed_the_longest_latest_match(hist, gamma, want):
    got = continuation(T(hist), gamma)
    assert (got.tolist() if got is not None else None) == want


def test_history_appends_kept_tokens_and_keeps_rows():
    h = History.start([[1, 2], [3]], T([5, 6]), capacity=10)
    h.append(T([[7, 8, 9], [4, -1, -1]]), T([2, 1]))
    assert h.length.tolist() == [5, 3]
    assert h.tokens[0, :5].tolist() == [1, 2, 5, 7, 8] and h.tokens[1, :3].tolist() == [3, 6, 4]
    h.keep(T([1]))
    assert h.length.tolist() == [3] and h.tokens[0, :3].tolist() == [3, 6, 4]


def test_teacher_forced_lookup_scores_the_copied_block():
    toks = T([1, 2, 3, 4, 1, 2, 3, 5, 6, 7, 8])
    hits, found = lookup_betas(toks, 4, 3, 3)  # anchors 4, 5, 6
    assert found.tolist() == [False, True, True]  # at 4 only "1" repeats; at 5 "1 2"; at 6 "1 2 3"
    assert hits[1].tolist() == [1.0, 0.0, 0.0]  # after "1 2": 3 4 1 proposed, 3 5 6 came
    assert hits[2].tolist() == [0.0, 0.0, 0.0]  # after "1 2 3": 4 1 2 proposed, 5 6 7 came


def _engine(family, policy="static:4", siblings=0):
    model = tiny_target(family)
    adapter = TargetAdapter(model, [0, 1])
    draft = random_draft(adapter, num_layers=1, block_size=4, markov_rank=8, confidence=True, seed=3)
    pol = parse_policy(policy, sps=SPSTable([1, 2, 4, 8, 16, 32, 64], [100.0] * 7))
    eng = SpeculativeEngine(adapter, draft, pol, SamplingParams(0.0), stop_token_ids=[1], siblings=siblings,
                            lookup=True)
    return model, eng


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [3, 4], [10, 11, 12, 10, 11, 12, 13, 10, 11], [20, 21, 20, 21]]


@pytest.mark.parametrize("family,policy,siblings", [("llama", "static:4", 0), ("qwen3", "dspark", "auto"),
                                                    ("llama", "static:2", 2)])
def test_greedy_output_is_the_targets_with_lookup_blocks_taken_and_refused(family, policy, siblings):
    model, eng = _engine(family, policy, siblings)
    base = plain_generate(TargetAdapter(model), PROMPTS, 40, SamplingParams(0.0), stop_token_ids=[1])
    seen = []
    real = eng.round

    def spy(live, *a):
        proposed, found = live.history.proposals(eng.draft.block_size)
        rd = real(live, *a)
        if rd.looked_up is not None:
            assert torch.equal(rd.looked_up, found)
            seen.append((rd.looked_up.clone(), rd.accepted.clone(), rd.verify_lengths.clone()))
            for r in found.nonzero().flatten().tolist():  # the copied block is what was verified
                n, ell = int(rd.accepted[r]), int(rd.verify_lengths[r])
                assert rd.emitted[r, :n].tolist() == proposed[r, :n].tolist()
                assert n == ell or int(rd.emitted[r, n]) != int(proposed[r, n])
        return rd
    eng.round = spy
    rep = eng.generate(PROMPTS, 40)
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in base.outputs]
    assert rep.streams.lookup.rounds == sum(int(lk.sum()) for lk, _, _ in seen) > 0
    accepted = torch.cat([acc[lk] for lk, acc, _ in seen])
    ell = torch.cat([e[lk] for lk, _, e in seen])
    assert (accepted > 0).any() and (accepted < ell).any()  # copies both accepted and cut short
    st = rep.streams
    assert st.speculative_tokens + st.plain_rows == sum(len(o.tokens) - 1 for o in rep.outputs)
    copied = torch.cat([acc[lk] for lk, acc, _ in seen])  # the lookup's stream holds its copies, the draft's none
    assert st.lookup.tokens == st.lookup.rounds + int(copied.sum())


def test_lookup_is_off_when_sampling_and_a_rewound_round_repeats_itself():
    model = tiny_target("llama")
    adapter = TargetAdapter(model, [0, 1])
    draft = random_draft(adapter, num_layers=1, block_size=4, markov_rank=8, seed=3)
    sampled = SpeculativeEngine(adapter, draft, parse_policy("static:4"), SamplingParams(1.0), lookup=True)
    assert not sampled.lookup
    _, eng = _engine("llama")
    live = eng.prefill(PROMPTS[:2], 40, None)
    from dsparkctl.engine.clock import Clock
    for _ in range(3):
        eng.round(live, 40, None, Clock(torch.device("cpu")))
    rewind = eng.mark(live)
    a = eng.round(live, 40, None, Clock(torch.device("cpu")))
    hist_a = [live.history.tokens[r, : int(n)].tolist() for r, n in enumerate(live.history.length)]
    rewind()
    b = eng.round(live, 40, None, Clock(torch.device("cpu")))
    hist_b = [live.history.tokens[r, : int(n)].tolist() for r, n in enumerate(live.history.length)]
    assert torch.equal(a.emitted, b.emitted) and hist_a == hist_b


def test_cli_lookup_is_used_kept_apart_and_refused_where_it_cannot_apply(tmp_path):
    """generate (default: lookup on) copies blocks and still prints plain decoding's tokens; its
    copies are counted apart from the draft's rounds; --no-lookup copies none; asked for under
    sampling it is refused, and left off by default there, saying so. eval-acceptance --lookup
    keeps the draft's own teacher-forced figures at the top, the pair's beside them. Real embedded
    target, one prompt."""
    runner = CliRunner()
    base = ["List the numbers one two three one two three one two", "--max-new-tokens", "24",
            "--policy", "static:5", "--json", "--no-text"]
    on = runner.invoke(app, ["generate", *base, "--baseline"])
    off = runner.invoke(app, ["generate", *base, "--no-lookup"])
    assert on.exit_code == 0 and off.exit_code == 0, (on.output, off.output)
    ron, roff = json.loads(on.stdout), json.loads(off.stdout)
    assert ron["lookup"]["setting"] == "auto" and ron["lookup"]["effective"] is True  # the default, on
    copied = ron["lookup"]["rows_verified_with"]
    assert copied > 0 and ron["lookup"]["acceptance"]["rounds"] == copied  # a lookup happened, counted apart
    assert ron["baseline"]["identical_outputs"] == 1  # ... and the tokens are plain decoding's
    eng = ron["engine"]
    assert eng["speculative_rounds"] == ron["acceptance"]["rounds"] + copied
    assert eng["tokens"] == ron["acceptance"]["tokens"] + ron["lookup"]["acceptance"]["tokens"]
    assert roff["lookup"]["effective"] is False and roff["lookup"]["rows_verified_with"] == 0
    assert roff["engine"]["speculative_rounds"] == roff["acceptance"]["rounds"]
    assert ron["requests"][0]["text"] == roff["requests"][0]["text"]
    hot = runner.invoke(app, ["generate", *base, "--temperature", "0.7", "--lookup"])
    assert hot.exit_code == 2 and "greedy" in hot.output and "Traceback" not in hot.output
    hot = runner.invoke(app, ["generate", *base, "--temperature", "0.7"])
    assert hot.exit_code == 0 and json.loads(hot.stdout)["lookup"]["effective"] is False
    out = tmp_path / "e.json"
    args = ["eval-acceptance", "--dataset", "mt-bench", "--limit", "2", "--max-new-tokens", "32",
            "--mode", "teacher-forced", "--lookup", "--out", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    tf = json.loads(out.read_text())["datasets"]["mt-bench"]["drafts"]
    tf = next(iter(tf.values()))["teacher_forced"]
    pair = tf["lookup"]["with_lookup"]
    assert pair["anchors"] == tf["anchors"] and 0 <= tf["lookup"]["anchors_looked_up"] <= tf["anchors"]
    if tf["lookup"]["anchors_looked_up"] == 0:
        assert tf["tau"] == pair["tau"]
    res = runner.invoke(app, [*args[:-2], "--temperature", "1"])
    assert res.exit_code == 2 and "greedy" in res.output


def test_a_lookup_row_never_widens_a_batchs_verify_and_teaches_the_gate_nothing():
    """Alone, a looked-up row verifies all γ; in a batch no wider than the policy chose for it (the
    widest row sets every row's width). The skip gate hears only the draft's own rows."""
    from types import SimpleNamespace

    _, eng = _engine("llama")
    g = eng.draft.block_size
    for rows, ell, want in ((1, [1], [g]), (2, [2, 1], [2, 2]), (3, [1, 3, 0], [3, 3, 3])):
        live = eng.prefill([[5, 6, 7]] * rows, 40, None)
        live.history = History.start([[5, 6, 7, 5, 6]] * rows, T([7] * rows), 64)  # "6 7" repeats: every row
        block = SimpleNamespace(tokens=torch.zeros(rows, g, dtype=torch.long))
        lengths, capped = T(ell), torch.zeros(rows, dtype=torch.bool)
        found = eng.look_up(live, block, lengths, capped, 40, live.history.proposals(g))
        assert found.all() and lengths.tolist() == want
        assert block.tokens[0].tolist() == [5, 6, 7, 5, 6][:g]  # what followed "6 7" the first time, on
    ell, acc = eng._the_drafts(T([5, 2]), T([3, 1]), T([True, False]))
    assert ell.tolist() == [0, 2] and acc.tolist() == [0, 1]


@pytest.mark.parametrize("policy", ["static:2", "dspark"])
def test_a_lone_row_that_looks_up_runs_no_draft(policy):
    """At batch 1 a round whose row has a copy verifies it without the draft's forward (whose block
    it would replace); the draft still reads those tokens later, and output stays the target's."""
    model, eng = _engine("llama", policy)
    prompt = PROMPTS[2]
    base = plain_generate(TargetAdapter(model), [prompt], 48, SamplingParams(0.0), stop_token_ids=[1])
    calls, rounds = [], []
    propose, real = eng.draft.propose, eng.round

    def counted(*a, **k):
        calls.append(1)
        return propose(*a, **k)

    def spy(live, *a):
        proposed, found = live.history.proposals(eng.draft.block_size)
        found = bool(found.all())
        before, budget = len(calls), 48 - int(live.produced[0]) - 1
        rd = real(live, *a)
        if found and rd.drafted:  # the copy is what was verified
            n, ell = int(rd.accepted[0]), int(rd.verify_lengths[0])
            assert rd.emitted[0, :n].tolist() == proposed[0, :n].tolist()
            assert n == ell or int(rd.emitted[0, n]) != int(proposed[0, n])
        if rd.drafted:
            rounds.append((found, len(calls) - before, rd.draft_ms, int(rd.verify_lengths[0]) - min(budget, 4)))
        return rd
    eng.draft.propose, eng.round = counted, spy
    rep = eng.generate([prompt], 48)
    assert [o.tokens for o in rep.outputs] == [o.tokens for o in base.outputs]
    copied = [r for r in rounds if r[0]]
    assert copied and all(n == 0 and ms == 0.0 for _, n, ms, _ in copied)
    assert all(gap == 0 for *_, gap in copied)  # all γ = 4 verified, within the budget
    assert all(n == 1 for f, n, _, _ in rounds if not f)  # a round without a copy drafts
    assert rep.streams.lookup.rounds == len(copied)
