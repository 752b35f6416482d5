"""Hostile inputs, round 4, class 3 (issue 28): an input made for something else (another draft,
block size, profile range, world) must be refused or said, never used silently. Each row is one
try: it names what is fed to what and asserts the right outcome; rows marked `was_wrong` failed
on the code before the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dsparkctl import distributed
from dsparkctl.app.calibrate import CalibrateSpec, run_calibrate
from dsparkctl.app.profile_sps import ProfileSpec, run_profile_sps
from dsparkctl.app.serve_config import ServeSpec, read_serve_inputs, run_serve_config
from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.errors import DsparkError
from dsparkctl.formats.sps import load_sps_table, save_sps_table
from dsparkctl.formats.trace import write_synthetic_trace
from dsparkctl.math.sps import SPSTable, StepGrid
from dsparkctl.math.synthetic import SyntheticModel
from dsparkctl.serving.engines import k_table_from_sweep
from dsparkctl.train.draft_init import check_against_target
from dsparkctl.train.recipe import load_recipe
from dsparkctl.tuning.sweep import sweep_traces
from tests.helpers import tiny_recipe, write_tiny_prompts
from tests.tiny_models import save_tiny_target, tiny_target, write_deepspec_draft

FP_A, FP_B = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"
G4 = SyntheticModel(gamma=4, mean_logit=(2.2, 1.8, 1.5, 1.2), overconfidence=(2.5,) * 4, bias=(0.0,) * 4)


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


def _profile(gamma: int) -> SPSTable:
    """A whole-step profile as profile-sps writes it: requests 1..8 × 1..γ+1 tokens, and the 1-D table."""
    reqs, toks = [1, 2, 4, 8], list(range(1, gamma + 2))
    ms = [[10.0 + 0.5 * r * t + 0.2 * r for t in toks] for r in reqs]
    grid = StepGrid(reqs, toks, ms, [9.0 + 0.3 * r for r in reqs])
    by_b: dict[int, list[float]] = {}
    for i, r in enumerate(reqs):
        for j, t in enumerate(toks):
            by_b.setdefault(r * t, []).append(ms[i][j])
    bt = sorted(by_b)
    step = [max(by_b[b]) for b in bt]
    step = [max(step[: i + 1]) for i in range(len(step))]
    return SPSTable(bt, [1000.0 / m for m in step], grid=grid,
                    meta={"measures": "whole-step", "block_size": gamma, "target": "tiny", "draft": "d"})


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile4")
    write_synthetic_trace(d / "a.jsonl", G4, 30, 8, seed=1, extra_header={"draft_fingerprint": FP_A})
    write_synthetic_trace(d / "a2.jsonl", G4, 30, 8, seed=2, extra_header={"draft_fingerprint": FP_A})
    write_synthetic_trace(d / "b.jsonl", G4, 30, 8, seed=3, extra_header={"draft_fingerprint": FP_B})
    write_synthetic_trace(d / "anon.jsonl", G4, 30, 8, seed=4)
    write_synthetic_trace(d / "g5.jsonl", SyntheticModel(), 30, 8, seed=5, extra_header={"draft_fingerprint": FP_A})
    run_calibrate(CalibrateSpec(traces=(d / "a2.jsonl",), out=d / "cal_a.json"))
    cal = json.loads((d / "cal_a.json").read_text())  # as an older calibrate wrote from two drafts' traces pooled
    (d / "cal_ab.json").write_text(json.dumps({**cal, "draft_fingerprints": [FP_A, FP_B]}))
    run_calibrate(CalibrateSpec(traces=(d / "g5.jsonl",), out=d / "cal_g5.json"))
    for gamma in (4, 5):
        save_sps_table(_profile(gamma), d / f"sps{gamma}.json")
        save_sps_table(_profile(gamma), d / f"sps{gamma}.sglang.json", fmt="sglang")
    err = json.loads((d / "sps4.json").read_text())
    (d / "sps4err.json").write_text(json.dumps({**err, "extrapolate": "error"}))
    served = {"format": "dsparkctl-served/1", "engine": "vllm", "drafts": 100, "source": {"kind": "metrics"},
              "per_position": [{"position": k + 1, "identified": True, "conditional": c}
                               for k, c in enumerate((0.8, 0.7, 0.6, 0.5))]}
    (d / "served4.json").write_text(json.dumps(served))
    (d / "served3.json").write_text(json.dumps({**served, "per_position": served["per_position"][:3]}))
    return d


def _sweep(d, traces=("a.jsonl",), sps="sps4.json", **kw):
    kw.setdefault("policy_specs", ["static:2", "dspark"] if "served" not in kw else None)
    kw.setdefault("concurrency", [1, 4, 64, 1024])
    kw.setdefault("rounds", 2048)
    return sweep_traces([d / t for t in traces], d / sps, **kw)


def _refused(fn, *words):
    with pytest.raises(DsparkError) as e:
        fn()
    text = e.value.one_line()
    assert all(w in text for w in words), text
    assert e.value.hint, text


def _thr(doc):
    return [(r["policy"], r["concurrency"], round(r["throughput_tok_s"], 6)) for r in doc["rows"]]


# ------------------------------------------------------------------ A: a calibration for another draft
CALIBRATION = [
    # (id, traces, calibration, expected: "refuse" words | "note" words | "ok", was_wrong)
    ("sweep: traces of draft B, calibration of A", ("b.jsonl",), "cal_a.json", ("refuse", "another draft", FP_B), True),
    ("sweep: traces of A and B, calibration of A", ("a.jsonl", "b.jsonl"), "cal_a.json",
     ("refuse", "record different runs to pool", FP_B), True),  # two drafts' rounds are never pooled
    ("sweep: traces of A, calibration of A and B", ("a.jsonl",), "cal_ab.json",
     ("refuse", "pooled traces of 2 drafts"), False),
    ("sweep: traces of A, calibration of A", ("a.jsonl",), "cal_a.json", ("ok",), False),
    ("sweep: traces of A, SGLang STS twin (names no draft)", ("a.jsonl",), "cal_a.sglang-sts.json",
     ("note", "does not say which draft"), True),
    ("sweep: traces that name no draft, calibration of A", ("anon.jsonl",), "cal_a.json",
     ("note", "do not say which draft recorded them"), True),
    ("sweep: traces of A and unnamed ones, calibration of A", ("a.jsonl", "anon.jsonl"), "cal_a.json",
     ("note", "anon.jsonl do not say"), True),
    ("sweep: traces of block size 4, calibration of 5 positions", ("a.jsonl",), "cal_g5.json",
     ("refuse", "block size 5"), False),
]


@pytest.mark.parametrize("traces,cal,expect,was_wrong", [c[1:] for c in CALIBRATION], ids=[c[0] for c in CALIBRATION])
def test_a_calibration_is_checked_against_the_drafts_of_the_rounds(d, traces, cal, expect, was_wrong):
    run = lambda: _sweep(d, traces, calibration=d / cal)  # noqa: E731
    if expect[0] == "refuse":
        _refused(run, *expect[1:])
        return
    doc = run()
    if expect[0] == "note":
        assert any(all(w in n for w in expect[1:]) for n in doc["notes"]), doc["notes"]
    else:
        assert not [n for n in doc["notes"] if "draft" in n], doc["notes"]


def test_a_served_sweep_says_its_calibration_cannot_be_checked(d):  # was wrong: used silently
    doc = sweep_traces((), d / "sps4.json", None, [1, 4], calibration=d / "cal_a.json", rounds=512,
                       served=d / "served4.json")
    assert any("served counts do not say which draft" in n for n in doc["notes"]), doc["notes"]


def test_the_sweep_cli_prints_its_notes_and_records_the_drafts(d):  # was wrong: no notes, no fingerprints
    res = CliRunner().invoke(app, ["sweep-scheduler", "--trace", str(d / "anon.jsonl"), "--sps-table",
                                   str(d / "sps4.json"), "--calibration", str(d / "cal_a.json"), "--policies",
                                   "static:2", "--concurrency", "1,4", "--rounds", "256", "--json"])
    assert res.exit_code == 0 and "note: the traces do not say which draft" in res.stderr, res.output
    doc = _sweep(d, ("a.jsonl",))
    assert doc["draft_fingerprints"] == [FP_A]


# ------------------------------------------------------------------ B: the twins of one SPS profile
def test_the_twins_price_every_step_beyond_the_profile_alike(d):  # was wrong: 165× apart at 1024 requests
    ours, twin = load_sps_table(d / "sps4.json"), load_sps_table(d / "sps4.sglang.json")
    assert ours.measured_tokens == twin.measured_tokens == 40
    for R in (8, 16, 64, 1024, 4096):
        b = torch.arange(41, 41 + 5 * R, 7, dtype=torch.float64)
        b = b[b >= R]
        if b.numel():
            assert torch.allclose(ours.step_seconds(R, b), twin.step_seconds(R, b)), R
    for R in (41, 1024):  # a plain step past the profile
        assert ours.plain_seconds(R) == pytest.approx(float(twin.step_seconds(R, torch.tensor(float(R)))))
    assert float(twin.step_seconds(1024, torch.tensor(5120.0))) > 20 * float(twin.step_seconds(8, torch.tensor(40.0)))


TWINS = [
    # static:K only: every request verifies K, so our padded layout and the twin's ragged one (another
    # engine, by design: math/sps.py "Verify layout") process the same batch tokens
    ("steady state, static:2 and static:4, 64 and 1024 requests",
     dict(concurrency=[64, 1024], policy_specs=["static:2", "static:4"])),
    ("finite batches of plain steps, 256 requests", dict(concurrency=[256], max_new_tokens=6,
                                                          policy_specs=["static:0"])),
    ("plain steps only (static:0) at 512 requests", dict(concurrency=[512], policy_specs=["static:0"])),
    ("served counts at 1024 requests", dict(concurrency=[1024], served="served4.json")),
]


@pytest.mark.parametrize("kw", [t[1] for t in TWINS], ids=[t[0] for t in TWINS])
def test_the_sweep_gives_one_answer_for_both_twins_beyond_the_profile(d, kw):  # each was wrong
    kw = dict(kw)
    traces = ("a.jsonl",)
    if "served" in kw:
        kw["served"], traces = d / kw["served"], ()
    ours, twin = _sweep(d, traces, "sps4.json", **kw), _sweep(d, traces, "sps4.sglang.json", **kw)
    assert [t[2] for t in _thr(ours)] == pytest.approx([t[2] for t in _thr(twin)], rel=1e-9)
    assert all(r["beyond_profile"] > 0 for r in ours["rows"]) and any("beyond the 40 batch tokens" in n
                                                                    for n in ours["notes"]), ours["notes"]


def test_a_table_that_refuses_extrapolation_refuses_it_with_a_grid_too(d):  # was wrong: the grid ignored it
    _refused(lambda: _sweep(d, sps="sps4err.json"), "beyond the table's last probe (40)")
    _sweep(d, sps="sps4err.json", concurrency=[1, 2])  # within the profile: priced as measured


def test_serve_config_builds_one_length_table_from_either_twin_beyond_the_profile(d):  # was wrong
    """vLLM's lengths for the batch sizes the profile did not measure (≥ 64 requests here) are the same
    whichever twin prices them; within it each prices what it holds (the grid, or B alone)."""
    def lengths(path):
        k = k_table_from_sweep(read_serve_inputs(path, None, None, d / "served4.json").sweep, 4)
        return [next(n for s, e, n in k if s <= c <= e) for c in (64, 128, 256, 512, 1024)]
    assert lengths(d / "sps4.json") == lengths(d / "sps4.sglang.json") != []


@pytest.mark.parametrize("traces,sps,was_wrong", [
    (("a.jsonl",), "sps5.json", True),  # traces of γ = 4, a table profiled with a draft of γ = 5
    (("g5.jsonl",), "sps4.json", True),
    ((), "sps5.json", True),  # served counts of γ = 4
])
def test_a_table_of_another_block_size_is_refused_by_the_sweep(d, traces, sps, was_wrong):
    kw = {} if traces else {"served": d / "served4.json"}
    _refused(lambda: _sweep(d, traces, sps, **kw), "profiled with a draft of block size")


# ------------------------------------------------------------------ C: one process's timing under torchrun
@pytest.mark.parametrize("rank,size", [(0, 2), (1, 2), (3, 4)])
def test_profile_sps_refuses_to_time_under_several_ranks(tmp_path, monkeypatch, rank, size):  # each was wrong
    monkeypatch.setenv("WORLD_SIZE", str(size))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    _refused(lambda: run_profile_sps(ProfileSpec(target="embedded", out=tmp_path / "sps.json")),
             f"rank {rank} of {size}", "times one process")
    assert not list(tmp_path.iterdir())


def test_profile_sps_cli_under_a_joined_world_is_one_line_exit_2(tmp_path, monkeypatch):  # was wrong
    from dsparkctl.cli import console

    monkeypatch.setattr(distributed, "_WORLD", distributed.World(rank=1, size=3, local_rank=1))
    monkeypatch.setattr(console.out, "_file", console.out._file)  # rank 1 silences stdout: restored after
    monkeypatch.setattr(console.err, "quiet", console.err.quiet)
    res = CliRunner().invoke(app, ["profile-sps", "--out", str(tmp_path / "sps.json")])
    assert res.exit_code == 2 and "profile-sps times one process, but this is rank 1 of 3" in res.output, res.output
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ D: train from a draft of another shape
@pytest.fixture(scope="module")
def tgt(tmp_path_factory):
    root = tmp_path_factory.mktemp("init")
    target = save_tiny_target(root / "target", "llama")
    write_tiny_prompts(root / "p.txt")
    return root, target, tiny_target("llama", vocab=64, layers=4)


def _recipe(root, target, init, **draft):
    (root / "r.toml").write_text(tiny_recipe(target, root / "p.txt", optim={"init_from": str(init)}))
    return load_recipe(root / "r.toml", [f"draft.{k}={json.dumps(v)}" for k, v in
                                         {"intermediate_size": 64, **draft}.items()])


INIT = [  # (id, draft folder kwargs, recipe [draft] overrides, words of the refusal or None, was_wrong)
    ("the same draft", {}, {}, None, False),
    ("block size 4 for a recipe of 3", {"block_size": 4}, {}, "its block_size is 4", True),
    ("block size 3 for a recipe of 5", {}, {"block_size": 5}, "its block_size is 3", True),
    ("taps 0,1 for a recipe tapping 0,2", {"taps": (0, 1)}, {}, "its target_layer_ids is [0, 1]", True),
    ("mask token 5 for a recipe of 2", {"overrides": {"mask_token_id": 5}}, {}, "its mask_token_id is 5", True),
    ("two layers for a recipe of one", {"layers": 2}, {}, "its num_hidden_layers is 2", True),
    ("a confidence head the recipe drops", {}, {"confidence": False}, "its enable_confidence_head is True", True),
    ("no confidence head, the recipe has one", {"confidence": False}, {}, "its enable_confidence_head is False",
     False),  # refused before only after the data were built (a missing tensor)
    ("Markov rank 16 for a recipe of 8", {"rank": 16}, {}, "its markov_rank is 16", False),  # late, by shape
    ("a gated Markov head for a vanilla recipe", {"overrides": {"markov_head_type": "gated"}}, {},
     "its markov_head_type is 'gated'", True),
    ("MLP width 96 for a recipe of 64", {"overrides": {"intermediate_size": 96}}, {}, "its intermediate_size is 96",
     False),  # late, by shape
]


@pytest.mark.parametrize("folder,recipe,words,was_wrong", [c[1:] for c in INIT], ids=[c[0] for c in INIT])
def test_init_from_must_be_the_recipes_draft_on_every_field_that_changes_meaning(tgt, tmp_path, folder, recipe,
                                                                                  words, was_wrong):
    root, target, model = tgt
    kw = {"taps": (0, 2), "block_size": 3, "rank": 8, **folder}
    init = write_deepspec_draft(tmp_path / "init", **kw)
    rec = _recipe(tmp_path, target, init, **recipe)
    if words is None:
        check_against_target(rec, model)
    else:
        _refused(lambda: check_against_target(rec, model), f"optim.init_from {init}: {words}")


# ------------------------------------------------------------------ E: serve-config and files of another draft
@pytest.fixture(scope="module")
def served_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    return root, save_tiny_target(root / "target", "llama"), write_deepspec_draft(root / "draft", block_size=4)


def _sweep_doc(path: Path, **kw) -> Path:
    doc = {"format": "dsparkctl-sweep/1", "block_size": 4, "acceptance_source": {"kind": "traces", "files": ["t"]},
           "rows": [{"policy": f"static:{k}", "concurrency": c, "throughput_tok_s": 1.0 + k}
                    for c in (1, 8) for k in (1, 2)], **kw}
    path.write_text(json.dumps(doc))
    return path


SERVE = [  # (id, spec fields from the fixture folder d, refusal words or None, was_wrong)
    ("a sweep of block size 6", {"sweep": ("sweep", {"block_size": 6})}, "the sweep was run for block size 6", True),
    ("a sweep of another draft's traces", {"sweep": ("sweep", {"draft_fingerprints": [FP_B]})},
     "the sweep replayed traces of another draft", True),
    ("a sweep that names no draft", {"sweep": ("sweep", {})}, None, False),
    ("served counts of block size 3", {"served": "served3.json", "sps_table": "sps4.sglang.json"},
     "the sweep was run for block size 3", True),
    ("our SPS table profiled at block size 5", {"sps_table": "sps5.json"},
     "the SPS table was profiled with a draft of block size 5", True),
    ("a calibration of another draft", {"calibration": "cal_a.json"}, "was fitted on traces of another draft", False),
    ("an STS file of 5 positions", {"calibration": "cal_g5.sglang-sts.json"}, "5 temperatures", False),
]


@pytest.mark.parametrize("files,words,was_wrong", [c[1:] for c in SERVE], ids=[c[0] for c in SERVE])
def test_serve_config_refuses_tuning_files_of_another_draft(d, served_models, tmp_path, files, words, was_wrong):
    root, target, draft = served_models
    spec = {}
    for k, v in files.items():
        spec[k] = _sweep_doc(tmp_path / "sweep.json", **v[1]) if k == "sweep" else d / v
    run = lambda: run_serve_config(ServeSpec(target=str(target), draft=str(draft), **spec))  # noqa: E731
    if words is None:
        run()
    else:
        _refused(run, words)
