"""Step costs (math/sps.py StepGrid, engine/profile.py fit_table, formats/sps.py format 2, the per-machine
cache) and the inputs that must be refused: tables without a plain step, non-monotone tables,
probes out of order, tables from another block size, calibrations of another draft."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.engine.profile import SPSPoint, fit_table
from dsparkctl.errors import InputError
from dsparkctl.formats.sps import load_sps_table, save_sps_table
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sps import SPSTable, StepGrid, fit_step_grid, isotonic
from tests.tiny_models import save_tiny_target, write_deepspec_draft

runner = CliRunner()


def test_isotonic_and_grid_fit_are_monotone():
    assert isotonic([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    assert isotonic([5, 4, 3], [1, 1, 2]) == pytest.approx([3.75] * 3)
    g = fit_step_grid([[10, 9, 12], [8, 14, 13], [20, 19, 25]])
    for row in g:
        assert all(b >= a for a, b in zip(row, row[1:]))
    for j in range(3):
        assert all(g[i + 1][j] >= g[i][j] for i in range(2))


def _points(noisy: bool = False) -> list[SPSPoint]:
    pts = []
    for r in (1, 2, 4):
        for t in (1, 2, 3):
            base = 10.0 * (1 + 0.3 * r) * (1 + 0.2 * (t - 1))
            if noisy and (r, t) == (2, 2):
                base = 5.0  # faster than verifying nothing: noise the fit must overrule
            pts.append(SPSPoint(r, t, [base * 1.02, base, base]))  # lower quartile and median: base
        pts.append(SPSPoint(r, 1, [8.0 * (1 + 0.3 * r)] * 3, plain=True))
    return pts


def test_fit_table_keeps_raw_probes_and_warns_where_they_contradict_the_fit(tmp_path):
    table, warnings = fit_table(_points(noisy=True), {"block_size": 2})
    assert any("2 request(s) × 2 token(s): raw lower quartile 5.00 ms" in w for w in warnings)
    fitted_t1 = [row[0] for row in table.grid.step_ms]  # the noisy (2, 2) probe drags (2, 1) down to 11.75
    assert fitted_t1[1] == pytest.approx(11.75)
    # plain: the raw 10.4, 12.8, 17.6, held at or below the drafted step that verifies nothing
    assert table.has_plain and table.grid.plain_ms == pytest.approx([10.4, 11.75, 17.6])
    assert any("plain step at 2 request(s)" in w for w in warnings)
    assert all(b <= a for a, b in zip(table.steps_per_sec, table.steps_per_sec[1:]))  # monotone 1-D twin
    # lookups: the grid at its probes, interpolated between request counts, plain steps
    assert float(table.step_seconds(4, torch.tensor(12.0))) == pytest.approx(table.grid.step_ms[2][2] / 1000)
    assert table.plain_seconds(3) == pytest.approx((11.75 + 17.6) / 2 / 1000)
    path = tmp_path / "t.json"
    save_sps_table(table, path)
    back = load_sps_table(path)
    assert json.loads(path.read_text())["format"] == "dsparkctl-sps/2"
    assert back.grid.step_ms == table.grid.to_json()["step_ms"] and back.has_plain


@pytest.mark.parametrize("edit,msg", [
    (lambda d: d["grid"]["step_ms"][0].reverse(), "not monotone"),
    (lambda d: d["grid"].update(requests=[4, 2, 1]), "not strictly increasing"),
    (lambda d: d["grid"].update(plain_ms=[30.0, 20.0, 10.0]), "plain step time falls"),
    (lambda d: d["grid"].update(plain_ms=[1.0]), "plain_ms must hold 3"),
    (lambda d: d.pop("grid"), "needs a 'grid'"),
    (lambda d: d["grid"].update(verify="diagonal"), "verify layout 'diagonal'"),
    (lambda d: d.update(steps_per_sec=[1.0] + d["steps_per_sec"][1:-1] + [1e6]), "not monotone"),
    (lambda d: d.update(batch_tokens=list(reversed(d["batch_tokens"]))), "not strictly increasing"),
])
def test_damaged_tables_are_refused_in_one_line(tmp_path, edit, msg):
    table, _ = fit_table(_points(), {"block_size": 2})
    path = tmp_path / "t.json"
    save_sps_table(table, path)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=msg):
        load_sps_table(path)


def test_sglang_table_that_speeds_up_with_more_tokens_is_refused(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"sample_batch_tokens": [1, 2, 4], "sample_steps_per_sec": [10.0, 12.0, 8.0],
                             "max_batch_tokens": 4}))
    with pytest.raises(InputError, match="steps/s rises"):
        load_sps_table(p)


def test_policies_use_the_plain_step_only_when_the_table_has_one():
    table, _ = fit_table(_points(), {"block_size": 2})
    old = SPSTable(table.batch_tokens, table.steps_per_sec)
    assert parse_policy("dspark-async", sps=table).can_skip and not parse_policy("dspark-async", sps=old).can_skip
    assert parse_policy("static:0").can_skip and not parse_policy("static:1").can_skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return (save_tiny_target(root / "target", "qwen3", vocab=64, layers=4),
            write_deepspec_draft(root / "draft", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4),
            write_deepspec_draft(root / "other", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4, seed=7))


def _gen(target, draft, *extra):
    return runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--no-chat",
                               "--max-new-tokens", "8", "--json", *map(str, extra), "w1 w2", "w3"])


def test_machine_table_is_profiled_once_and_cached(pair, tmp_path, monkeypatch):
    target, draft, _ = pair
    monkeypatch.setenv("DSPARKCTL_SPS_CACHE", str(tmp_path / "cache" / "sps"))
    first = _gen(target, draft, "--policy", "dspark")
    assert first.exit_code == 0, first.output
    assert "profiling this machine's step costs once" in first.stderr
    cached = list((tmp_path / "cache" / "sps").glob("*.json"))
    assert len(cached) == 1 and load_sps_table(cached[0]).has_plain
    again = _gen(target, draft, "--policy", "dspark-async")
    assert again.exit_code == 0 and "profiling" not in again.stderr, again.output


def test_inputs_from_another_draft_or_block_size_are_refused(pair, tmp_path):
    target, draft, other = pair
    sps = tmp_path / "sps5.json"
    table, _ = fit_table([SPSPoint(r, t, [10.0 * r * t] * 2) for r in (1, 2) for t in (1, 2)], {"block_size": 5})
    save_sps_table(table, sps)
    res = _gen(target, draft, "--policy", "dspark", "--sps-table", sps)
    assert res.exit_code == 2 and "block size 5" in res.stderr and res.stdout == ""
    trace = tmp_path / "t.jsonl"
    assert _gen(target, other, "--trace", trace).exit_code == 0
    cal = tmp_path / "cal.json"
    assert runner.invoke(app, ["calibrate", str(trace), "--out", str(cal), "--bins", "2",
                               "--holdout", "0.5"]).exit_code == 0
    res = _gen(target, draft, "--policy", "static:2", "--calibration", cal)
    assert res.exit_code == 2 and "another draft" in res.stderr and res.stdout == ""
    res = _gen(target, other, "--policy", "static:2", "--calibration", cal)
    assert res.exit_code == 0, res.output


def test_a_table_without_a_plain_step_is_used_with_a_note(pair, tmp_path):
    target, draft, _ = pair
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "dsparkctl-sps/1", "batch_tokens": [1, 2, 4], "steps_per_sec": [10, 9, 8]}))
    res = _gen(target, draft, "--policy", "dspark-async", "--sps-table", old)
    assert res.exit_code == 0, res.output
    assert "no plain-step entry" in res.stderr and "does not say what machine" in res.stderr


def test_traces_mark_plain_steps_and_calibration_skips_them(tmp_path):
    from dsparkctl.formats.trace import TRACE_FORMAT, read_trace
    from dsparkctl.tuning.calibration import calibrate_traces

    lines = [{"format": TRACE_FORMAT}]
    for req in range(8):
        for rnd in range(30):
            plain = rnd % 3 == 2
            lines.append({"request": req, "round": rnd, "block_size": 2, "batch_tokens": 8,
                          "confidence_logits": None if plain else [0.5 * (rnd % 5) - 1, -0.5],
                          "verify_length": 0 if plain else 2, "accepted": 0 if plain else (rnd + req) % 3,
                          "draft_ms": 0.0 if plain else 1.0, "verify_ms": 5.0, **({"drafted": False} if plain else {})})
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert sum(not r.drafted for r in read_trace(p).rounds) == 80
    res = calibrate_traces([p], holdout=0.25, bins=4)
    assert res["rounds"]["train"] + res["rounds"]["heldout"] == 160  # the 80 plain steps carry no labels
    bad = tmp_path / "bad.jsonl"
    lines[1] = {**lines[1], "drafted": False}  # a plain step cannot have verified drafts
    bad.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(InputError, match="without a draft must have verify_length 0"):
        read_trace(bad)


def test_the_gate_starts_from_the_prior_and_every_batch_starts_alike():
    """At a load where a plain step wins, a prior survival profile makes the first step plain;
    a reset (a new batch) starts from the prior again (a run split across ranks decides alike)."""
    table, _ = fit_table(_points(), {"block_size": 2})
    low = parse_policy("dspark-async", sps=table, prior=[0.05, 0.01])
    assert low.plan(4) is False  # no draft has run yet: the prior decides
    high = parse_policy("dspark-async", sps=table)
    assert high.plan(4) is True  # no prior, no estimate: draft and learn
    for _ in range(12):
        if low.plan(4):
            low.choose(torch.full((4, 2), -4.0))
    low.reset()
    assert torch.equal(low.state.profile, low.prior) and low.state.step == 0 and low.state.skipped == 0


def test_a_damaged_machine_table_is_profiled_again(pair, tmp_path, monkeypatch):
    target, draft, _ = pair
    monkeypatch.setenv("DSPARKCTL_SPS_CACHE", str(tmp_path / "sps"))
    assert _gen(target, draft, "--policy", "dspark").exit_code == 0
    (path,) = (tmp_path / "sps").glob("*.json")
    path.write_text("{not json")
    res = _gen(target, draft, "--policy", "dspark")
    assert res.exit_code == 0 and "profiling this machine's step costs once" in res.stderr, res.output
    # no longer provably the cache's own (not what it recorded writing, nor in its format): left as it is, said
    assert path.read_text() == "{not json" and "used for this run only" in res.stderr, res.stderr
    path.unlink()  # the user removes it, as the note says: the next run caches its table again
    assert _gen(target, draft, "--policy", "dspark").exit_code == 0
    assert load_sps_table(path).has_plain


def test_the_draft_fingerprint_does_not_depend_on_the_kernels():
    """A calibration records the draft's fingerprint; packing the draft's linears for the CPU
    kernels (biases become buffers) must not change it, another draft must."""
    from dsparkctl.models.draft_io import random_draft
    from dsparkctl.models.packed_linear import pack_linears, packing_supported
    from dsparkctl.models.target import TargetAdapter
    from tests.tiny_models import tiny_target

    tgt = TargetAdapter(tiny_target("llama"), [0, 1])
    d = random_draft(tgt, seed=1, block_size=3, markov_rank=4, layer_ids=[0, 1])
    fp = d.fingerprint()
    assert random_draft(tgt, seed=2, block_size=3, markov_rank=4, layer_ids=[0, 1]).fingerprint() != fp
    if packing_supported(tgt.model):
        pack_linears(d, keep_weight=True)
        assert d.fingerprint() == fp


def test_a_fifo_at_the_machine_table_path_is_left_alone(pair, tmp_path, monkeypatch):
    import os

    target, draft, _ = pair
    monkeypatch.setenv("DSPARKCTL_SPS_CACHE", str(tmp_path / "sps"))
    assert _gen(target, draft, "--policy", "dspark").exit_code == 0
    (path,) = (tmp_path / "sps").glob("*.json")
    path.unlink()
    os.mkfifo(path)
    res = _gen(target, draft, "--policy", "dspark")
    assert res.exit_code == 0 and "used for this run only" in res.stderr, res.output
    assert path.is_fifo()


def _flat_grid(verify: str, R: int = 2) -> SPSTable:
    """Step time 10 ms × tokens per request (1..4) at every request count; plain step 8 ms."""
    grid = StepGrid([1, R], [1, 2, 3, 4], [[10.0, 20.0, 30.0, 40.0]] * 2, [8.0, 8.0], verify=verify)
    return SPSTable([1, 2], [1.0, 1.0], grid=grid)


def test_a_padded_step_costs_its_longest_verify_for_every_request(tmp_path):
    """dsparkctl's engine verifies a [R, 1 + max ℓ] rectangle: one long verify makes the whole step long."""
    padded, ragged = _flat_grid("padded"), _flat_grid("ragged")
    ell = torch.tensor([[0, 2], [1, 1], [3, 0]])
    assert padded.lengths_seconds(ell).tolist() == pytest.approx([0.030, 0.020, 0.040])
    assert ragged.lengths_seconds(ell).tolist() == pytest.approx([0.020, 0.020, 0.025])  # t = Σ(1+ℓ)/R
    assert padded.level_curve(2, 3).tolist() == pytest.approx([0.010, 0.020, 0.030, 0.040])
    for table in (padded, ragged):  # the layout survives a save and a load
        save_sps_table(table, tmp_path / f"{table.grid.verify}.json")
        assert load_sps_table(tmp_path / f"{table.grid.verify}.json").padded == (table is padded)
    doc = json.loads((tmp_path / "padded.json").read_text())
    del doc["grid"]["verify"]  # tables written before the field existed were measured padded
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert load_sps_table(tmp_path / "old.json").padded
    assert not SPSTable([1, 2], [1.0, 1.0]).padded  # a 1-D table counts batch tokens


def _uniform_best(a: torch.Tensor, table: SPSTable) -> float:
    from dsparkctl.math.admission import expected_throughput

    R, gamma = a.shape
    return max(float(expected_throughput(a, torch.full((R,), L), table)) for L in range(gamma + 1))


def test_on_a_padded_table_the_theta_search_admits_whole_levels():
    """Below the longest verify a draft is free, beyond it a whole level is paid: dspark verifies
    the same L for every request (the first L where Θ stops rising), the unrestricted search the
    best L, and no length vector beats the best whole level."""
    from dsparkctl.math.admission import expected_throughput

    gen = torch.Generator().manual_seed(0)
    grid = StepGrid([1, 4], [1, 2, 3, 4], [[10.0, 13.0, 17.0, 22.0], [12.0, 18.0, 25.0, 33.0]], [9.0, 10.0])
    table = SPSTable([1, 2], [1.0, 1.0], grid=grid)
    dspark, retro = parse_policy("dspark", sps=table), parse_policy("retrospective", sps=table)
    for _ in range(200):
        a = torch.cumprod(torch.rand(4, 3, generator=gen, dtype=torch.float64), dim=1)  # survivals [R, γ]
        got = dspark.choose_batched(a.unsqueeze(0))[0]
        assert len(set(got.tolist())) == 1
        theta = [float(expected_throughput(a, torch.full((4,), L), table)) for L in range(4)]
        L = next((i for i in range(3) if theta[i + 1] <= theta[i]), 3)
        assert int(got[0]) == L
        best = retro.choose_batched(a.unsqueeze(0))[0]
        assert float(expected_throughput(a, best, table)) == pytest.approx(_uniform_best(a, table), rel=1e-12)
        ragged_choice = torch.randint(0, 4, (4,), generator=gen)
        assert float(expected_throughput(a, ragged_choice, table)) <= _uniform_best(a, table) * (1 + 1e-12)


def test_the_machine_table_profiles_only_the_request_counts_a_run_reaches(pair, tmp_path, monkeypatch):
    """A batch-1 run profiles one request count (with a time estimate), a wider run the counts up to
    its batch; a cached wider table then serves the narrower need without profiling again."""
    from dsparkctl.engine.sps_cache import requests_for

    assert [requests_for(b) for b in (1, 2, 3, 8, 64, None)] == \
        [(1,), (1, 2), (1, 2, 4), (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)]
    target, draft, _ = pair
    monkeypatch.setenv("DSPARKCTL_SPS_CACHE", str(tmp_path / "sps"))
    one = _gen(target, draft, "--policy", "dspark", "--batch-size", "1")
    assert one.exit_code == 0, one.output
    assert "requests 1 × 1..5 tokens" in one.stderr and "s left" in one.stderr
    (path,) = (tmp_path / "sps").glob("*.json")
    assert load_sps_table(path).grid.requests == [1]
    two = _gen(target, draft, "--policy", "dspark", "--batch-size", "2")
    assert two.exit_code == 0 and "requests 1,2 × 1..5 tokens" in two.stderr, two.output
    assert sorted(load_sps_table(p).grid.requests for p in (tmp_path / "sps").glob("*.json")) == [[1], [1, 2]]
    again = _gen(target, draft, "--policy", "dspark", "--batch-size", "1")
    assert again.exit_code == 0 and "profiling" not in again.stderr, again.output


@pytest.mark.parametrize("drafted, steps, said", [(0, 40, "never drafted"), (3, 40, "drafted in 3 of 40 steps"),
                                                  (20, 40, None), (0, 0, None)])
def test_a_scheduler_that_drafts_rarely_says_so_and_why(drafted, steps, said):
    from dsparkctl.engine.policy_choice import scheduler_note

    grid = StepGrid([1, 2], [1, 2, 3], [[12.0, 15.0, 18.0], [14.0, 18.0, 22.0]], [10.0, 12.0])
    pol = parse_policy("dspark", sps=SPSTable([1, 2], [1.0, 1.0], grid=grid))
    note = scheduler_note(pol, drafted, steps, requests=1, gamma=2)
    if said is None:
        assert note is None
    else:
        assert said in note and "10.0 ms" in note and "15.0 ms (1.50x)" in note and "18.0 ms (1.80x)" in note
    assert scheduler_note(parse_policy("static:2"), 0, 40, requests=1, gamma=2) is None  # no table: it cannot skip


def test_the_fit_reads_each_probes_lower_quartile_so_interference_does_not_reorder_steps():
    """Interference only adds time: two probes of a 3-token step slowed by a busy neighbour must not
    make it look cheaper than the 2-token step, as their medians would."""
    quiet = {1: 30.0, 2: 31.0, 3: 32.0}
    pts = []
    for t, base in quiet.items():
        ms = [base, base + 0.2, base + 0.1, base + 0.3, base + 0.2]
        if t == 2:
            ms = [base, base + 0.1, base + 9.0, base + 8.0, base + 7.5]  # three of five probes hit
        pts.append(SPSPoint(1, t, ms))
    assert SPSPoint(1, 2, pts[1].ms).median_ms > quiet[3] + 5  # the median is misled
    table, _ = fit_table(pts, {"block_size": 2})
    row = table.grid.step_ms[0]
    assert row[0] < row[1] < row[2] and row[1] == pytest.approx(31.1)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_the_gate_drafts_only_where_drafting_wins_by_its_margin(R):
    """A prior whose drafts win on paper by less than the margin keeps the steps plain; one that
    wins by more drafts. The margin is applied to the table's own Θ: GATE_MARGIN (10%) for several
    requests, SOLO_MARGIN (none) for one, whose drafted step has no ragged rows to pay for."""
    from dsparkctl.math.admission import admission, plain_theta
    from dsparkctl.math.policies import gate_margin

    table, _ = fit_table(_points(), {"block_size": 2})

    def gain(prior: list[float], R: int) -> float:
        theta, _ = admission(torch.tensor(prior, dtype=torch.float64).expand(1, R, -1), table)
        return float(theta[:, 1:].max()) / plain_theta(R, table) - 1

    margin = gate_margin(R)
    priors = [[a, a * a] for a in (0.02 * i for i in range(1, 50))]
    small = next(p for p in priors if margin - 0.1 < gain(p, R) <= margin)  # short of the margin, by < 10%
    large = next(p for p in priors if gain(p, R) > margin)
    assert parse_policy("dspark", sps=table, prior=small).plan(R) is False
    assert parse_policy("dspark", sps=table, prior=large).plan(R) is True
