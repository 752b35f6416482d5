"""Acceptance evaluation: teacher-forced aggregation, live vs teacher-forced agreement, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.evaluation.acceptance import DraftUnderTest, evaluate_dataset, trace_path
from dsparkctl.evaluation.teacher_forced import TeacherForcedStats, sequence_betas
from dsparkctl.formats.trace import read_trace
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import bigram_oracle_draft, save_tiny_target, tiny_target, write_deepspec_draft

runner = CliRunner()


def test_teacher_forced_stats_on_hand_values():
    st = TeacherForcedStats(block_size=2)
    st.add(torch.tensor([[1.0, 0.5], [0.5, 1.0]]))  # s = [1, .5], [.5, .5]
    st.add(torch.tensor([[0.0, 1.0]]))  # s = [0, 0]
    st.add(torch.zeros(0, 2))  # nothing
    assert st.anchors == 3 and st.positions == 6
    assert st.survival() == pytest.approx([1.5 / 3, 1.0 / 3])
    assert st.conditional() == pytest.approx([0.5, 1.0 / 1.5])
    assert st.tau == pytest.approx(1 + 1.5 / 3 + 1.0 / 3)
    # cluster-robust intervals (clusters = sequences): c_1 = 1.5/3 with se 1/3 spans all of [0, 1]; a_2 = 1/3 with
    # se 2/9; τ - 1 = 2.5/3 with se 5/9, clipped to [0, γ] rather than [0, 1]
    assert st.conditional_interval()[0] == pytest.approx((0.0, 1.0))
    assert st.survival_interval()[1] == pytest.approx((0.0, 1 / 3 + 1.96 * 2 / 9))
    assert st.tau_interval() == pytest.approx((1.0, 1 + 2.5 / 3 + 1.96 * 5 / 9))


@pytest.fixture(scope="module")
def tiny():
    model = tiny_target("qwen3", vocab=64, layers=4)
    adapter = TargetAdapter(model, (0, 1))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (24,), generator=g)]
    draft = bigram_oracle_draft(adapter, prompts[:8], steps=24, block_size=4)
    return model, draft, prompts


def test_betas_are_probabilities_and_greedy_is_exact_match(tiny):
    model, draft, prompts = tiny
    seq = prompts[0] + [5, 9, 11, 13, 17, 19, 23]
    out = model(torch.tensor([seq]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in draft.cfg.target_layer_ids], -1)[0]
    b1 = sequence_betas(draft, torch.tensor(seq), feats, out.logits[0], len(prompts[0]), SamplingParams(1.0))
    b0 = sequence_betas(draft, torch.tensor(seq), feats, out.logits[0], len(prompts[0]), SamplingParams(0.0))
    assert b1.shape == (len(seq) - len(prompts[0]) - 4, 4)
    assert ((b1 >= 0) & (b1 <= 1)).all()
    assert set(b0.unique().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("temperature", [1.0])
def test_live_and_teacher_forced_agree_within_95_percent(tiny, temperature):
    # T = 1 only: on this tiny, loop-prone target greedy live rounds start right after rejections
    # (non-uniform anchors), a real selection effect documented in docs/eval.md; the real draft's
    # greedy runs agree (benchmarks/results/acceptance_greedy.json).
    model, draft, prompts = tiny
    res = evaluate_dataset(model, [DraftUnderTest("oracle", draft, "mem")], prompts, mode="both",
                           params=SamplingParams(temperature), max_new_tokens=40, stop_ids=[], seed=0,
                           batch_size=8)
    r = res["drafts"]["oracle"]
    live, tf = r["live"], r["teacher_forced"]
    assert live["rounds"] > 50 and tf["anchors"] > 300
    assert 1.1 < live["tau"] < 3.9  # multi-token accepts and rejections both happen
    assert r["agreement"]["all_overlap"], r["agreement"]
    widths = [iv[1] - iv[0] for iv in live["conditional_interval"][:2]]
    assert max(widths) < 0.35  # the check is not vacuous: the first positions are well measured


def test_cli_eval_json_plot_trace_and_mismatch(tmp_path):
    target = save_tiny_target(tmp_path / "target", "qwen3", vocab=64, layers=4)
    draft = write_deepspec_draft(tmp_path / "draft", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4)
    prompts = tmp_path / "p.txt"
    prompts.write_text("w1 w2 w3\nw4 w5\nw6 w7 w8 w9\n")
    plot, trace = tmp_path / "fig.png", tmp_path / "t.jsonl"
    res = runner.invoke(app, ["eval-acceptance", "--target", str(target), "--draft", str(draft), "--draft", str(draft),
                              "--out", str(tmp_path / "r.json"),
                              "--label", "a", "--label", "b", "--dataset", str(prompts), "--max-new-tokens", "12",
                              "--temperature", "1.0", "--json", "--plot", str(plot), "--trace", str(trace)])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert json.loads((tmp_path / "r.json").read_text()) == rep
    assert (rep["mode"], rep["temperature"], rep["max_new_tokens"]) == ("both", 1.0, 12)
    d = rep["datasets"][str(prompts)]["drafts"]
    assert set(d) == {"a", "b"}
    # one draft under two labels, same seed: the same rollouts and the same teacher-forced pass
    for mode, keys in (("live", ("rounds", "tokens", "histogram", "reached", "accepted_at", "tau")),
                       ("teacher_forced", ("anchors", "tau", "conditional", "survival"))):
        assert {k: d["a"][mode][k] for k in keys} == {k: d["b"][mode][k] for k in keys}, mode
    assert d["a"]["teacher_forced"]["continuations"] == "live outputs"
    # two drafts: one trace per (dataset, draft), named <stem>.<dataset stem>_<label>.jsonl, rounds = live rounds
    for label in ("a", "b"):
        path = tmp_path / f"t.p_{label}.jsonl"
        assert d[label]["trace"] == str(path)
        tr = read_trace(path)
        assert (tr.header["dataset"], tr.header["policy"]) == (str(prompts), "static:4")
        assert len(tr.rounds) == d[label]["live"]["rounds"]
    assert not trace.exists() and sorted(p.name for p in tmp_path.glob("t*.jsonl")) == ["t.p_a.jsonl", "t.p_b.jsonl"]
    assert plot.read_bytes()[:4] == b"\x89PNG" and rep["plot"] == str(plot)
    # a draft whose vocabulary differs from the target's: one line, exit != 0
    bad = write_deepspec_draft(tmp_path / "bad", vocab=80, hidden=32, taps=(0, 1), rank=8)
    res = runner.invoke(app, ["eval-acceptance", "--target", str(target), "--draft", str(bad), "--dataset", str(prompts)])
    assert res.exit_code != 0 and "vocabulary 80 != target vocabulary 64" in res.output
    lines = [ln for ln in res.output.replace("\r", "\n").splitlines() if ln.strip() and "Loading weights" not in ln]
    assert len(lines) == 1 and lines[0].startswith("error:")


@pytest.mark.parametrize("trace,dataset,label,several,expect", [
    (None, "mt-bench", "a", True, None),
    ("out/t.jsonl", "mt-bench", "a", False, "out/t.jsonl"),
    ("out/t.jsonl", "mt-bench", "a", True, "out/t.mt-bench_a.jsonl"),
    ("out/t.jsonl", "data/p.txt", "my draft/v2", True, "out/t.p_my_draft_v2.jsonl"),
    ("out/t", "humaneval", "b", True, "out/t.humaneval_b.jsonl"),
])
def test_trace_path_names_one_file_per_dataset_and_draft(trace, dataset, label, several, expect):
    from pathlib import Path

    got = trace_path(Path(trace) if trace else None, dataset, label, several)
    assert got == (Path(expect) if expect else None)


def test_cli_empty_prompt_rows_are_one_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "hello"}\n{"prompt": "   "}\n')
    res = runner.invoke(app, ["eval-acceptance", "--dataset", str(p)])
    assert res.exit_code != 0 and "row 2: empty prompt" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_continuation_shorter_than_a_block_has_no_anchors(tiny):
    model, draft, prompts = tiny
    seq = prompts[0] + [5, 1]  # the target stopped after two tokens (< γ)
    out = model(torch.tensor([seq]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in draft.cfg.target_layer_ids], -1)[0]
    b = sequence_betas(draft, torch.tensor(seq), feats, out.logits[0], len(prompts[0]), SamplingParams(1.0))
    assert b.shape == (0, 4)


def test_live_mode_scores_the_confidence_head_with_the_drafts_own_calibration(tmp_path):
    """A draft folder's calibration.json (fitted on this draft's traces) is applied by default;
    one fitted for another draft is not (raw scores only)."""
    target = save_tiny_target(tmp_path / "target", "qwen3", vocab=64, layers=4)
    draft = write_deepspec_draft(tmp_path / "draft", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4)
    prompts = tmp_path / "p.txt"
    prompts.write_text("w1 w2 w3\nw4 w5\nw6 w7 w8 w9\n")
    base = ["eval-acceptance", "--target", str(target), "--draft", str(draft), "--dataset", str(prompts),
            "--max-new-tokens", "24", "--temperature", "1.0", "--mode", "live", "--json"]

    def confidence(*extra):
        res = runner.invoke(app, base + list(extra))
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["datasets"][str(prompts)]["drafts"][draft.name]["live"]["confidence"]

    raw = confidence("--trace", str(tmp_path / "t.jsonl"))
    assert raw["calibration"] is None and raw["temperatures"] is None and raw["rounds"] > 0
    assert [p["position"] for p in raw["positions"]] == [1, 2, 3, 4] and raw["positions"][0]["calibrated"] is None
    res = runner.invoke(app, ["calibrate", str(tmp_path / "t.jsonl"), "--out", str(draft / "calibration.json")])
    assert res.exit_code == 0, res.output
    cal = confidence()
    assert cal["calibration"] == str(draft / "calibration.json")
    assert cal["temperatures"] == json.loads((draft / "calibration.json").read_text())["temperatures"]
    assert cal["positions"][0]["raw"] == raw["positions"][0]["raw"]  # same rollouts, same raw scores
    assert cal["positions"][0]["calibrated"]["ece"] is not None
    doc = json.loads((draft / "calibration.json").read_text())
    doc["draft_fingerprints"] = ["0" * 16]  # another draft's
    (draft / "calibration.json").write_text(json.dumps(doc))
    assert confidence()["calibration"] is None


def test_a_damaged_own_calibration_is_refused_in_one_line_before_the_rollouts(tmp_path):
    target = save_tiny_target(tmp_path / "target", "qwen3", vocab=64, layers=4)
    draft = write_deepspec_draft(tmp_path / "draft [v2]", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4)
    prompts = tmp_path / "p.txt"
    prompts.write_text("w1 w2 w3\n")
    (draft / "calibration.json").write_text('{"temperatures": [NaN, 1, 1, 1], "draft_fingerprints": []}')
    res = runner.invoke(app, ["eval-acceptance", "--target", str(target), "--draft", str(draft), "--dataset",
                              str(prompts), "--mode", "live", "--max-new-tokens", "8", "--out", str(tmp_path / "o.json")])
    assert res.exit_code == 2 and "calibration.json: NaN is not a JSON number" in res.output
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("command", ["generate", "eval-acceptance"])
def test_requests_past_the_targets_positions_are_refused_before_decoding(command, tmp_path):
    """One rule for both generating commands: prompt + --max-new-tokens + a block must fit the
    target's positions; refused in one line naming the flag, nothing written."""
    target = save_tiny_target(tmp_path / "target", "llama", vocab=64, layers=4)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 24}))
    draft = write_deepspec_draft(tmp_path / "draft", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4)
    prompts = tmp_path / "p.txt"
    prompts.write_text("w1 w2 w3\nw4 w5 w6 w7 w8 w9\n")
    out = tmp_path / "r.json"
    source = ["--prompts-file", str(prompts)] if command == "generate" else ["--dataset", str(prompts)]
    extra = ["--trace", str(out)] if command == "generate" else ["--out", str(out)]
    base = [command, "--target", str(target), "--draft", str(draft), "--no-chat", *source, *extra]
    res = runner.invoke(app, [*base, "--max-new-tokens", "40"])
    assert res.exit_code == 2, res.output
    assert "the longest prompt (6 tokens) + --max-new-tokens 40 runs past the target's 24 positions" in res.output
    assert "use --max-new-tokens ≤ 13" in res.output and not out.exists()
    res = runner.invoke(app, [*base, "--max-new-tokens", "12", "--policy" if command == "generate" else "--mode",
                              "static:2" if command == "generate" else "live"])
    assert res.exit_code == 0, res.output  # within the positions it runs
