"""`dsparkctl generate` end to end on a tiny saved target + a miniature DeepSpec draft checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.formats.trace import read_trace
from tests.tiny_models import save_tiny_target, write_deepspec_draft

runner = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = save_tiny_target(root / "target", "qwen3", vocab=64, layers=4)
    draft = write_deepspec_draft(root / "draft", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4)
    return root, target, draft


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_generate_json_trace_and_baseline(models, tmp_path):
    root, target, draft = models
    trace = tmp_path / "t.jsonl"
    res = run("generate", "--target", target, "--draft", draft, "--no-chat", "--max-new-tokens", 12,
              "--batch-size", 2, "--json", "--baseline", "--policy", "static:4", "--trace", trace,
              "w1 w2 w3", "w4 w5", "w6")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["block_size"] == 4 and rep["policy"] == "static:4" and rep["draft_kind"] == "dspark"
    assert rep["baseline"]["identical_outputs"] == 3
    acc = rep["acceptance"]
    tr = read_trace(trace)
    assert tr.header["block_size"] == 4 and tr.header["target"] == str(target)
    assert all(r.verify_length <= 4 and r.confidence_logits is not None for r in tr.rounds)
    assert len(tr.rounds) == acc["rounds"] == sum(r["rounds"] for r in rep["requests"])
    assert rep["generated_tokens"] == sum(r["generated_tokens"] for r in rep["requests"])
    # greedy decoding of this tiny target never emits <eos> within 12 tokens of these prompts (the plain
    # baseline gives the same tokens), so every request runs to its budget
    assert [(r["generated_tokens"], r["finish_reason"]) for r in rep["requests"]] == [(12, "length")] * 3
    for req in rep["requests"]:  # and the trace accounts for every token: prefill's, then accepted + 1 a round
        rounds = [r for r in tr.rounds if r.request == req["index"]]
        assert [r.round for r in rounds] == list(range(req["rounds"]))
        assert 1 + sum(r.accepted + 1 for r in rounds) == req["generated_tokens"]
    assert acc["tokens"] == sum(r.accepted + 1 for r in tr.rounds)


def test_repeats_time_both_decoders_and_report_medians(models, tmp_path):
    root, target, draft = models
    trace = tmp_path / "t.jsonl"
    res = run("generate", "--target", target, "--draft", draft, "--no-chat", "--max-new-tokens", 8,
              "--json", "--baseline", "--repeats", 3, "--trace", trace, "w1 w2 w3", "w4 w5")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    spec, plain = rep["tokens_per_s_runs"], rep["baseline"]["tokens_per_s_runs"]
    assert rep["repeats"] == 3 and len(spec) == len(plain) == 3
    assert rep["tokens_per_s"] == sorted(spec)[1] and rep["baseline"]["tokens_per_s"] == sorted(plain)[1]
    assert rep["speedup"] == sorted(a / b for a, b in zip(spec, plain))[1]
    assert rep["baseline"]["identical_outputs"] == 2
    # the trace and the statistics are the first run's only: no round is written three times
    assert len(read_trace(trace).rounds) == rep["acceptance"]["rounds"] == sum(r["rounds"] for r in rep["requests"])
    human = run("generate", "--target", target, "--draft", draft, "--no-chat", "--max-new-tokens", 4,
                "--baseline", "--repeats", 2, "w1 w2")
    assert human.exit_code == 0, human.output
    assert "median of 2" in human.stdout and "median of paired runs" in human.stdout
    bad = run("generate", "--target", target, "--draft", draft, "--repeats", 0, "w1")
    assert bad.exit_code == 2 and "--repeats" in bad.output


def test_generate_human_output_has_acceptance_table(models):
    _, target, draft = models
    res = run("generate", "--target", target, "--draft", draft, "--no-chat", "--max-new-tokens", 6,
              "--temperature", 0.8, "--top-p", 0.9, "--seed", 3, "w1 w2")
    assert res.exit_code == 0, res.output
    assert "τ (its chain" in res.stdout and "engine τ" in res.stdout and "survival" in res.stdout


def _bad(tmp_path, models, kind):
    root, target, draft = models
    base = ["generate", "--target", target, "--draft", draft, "--no-chat", "--max-new-tokens", 4]
    if kind == "unknown target":
        return ["generate", "--target", tmp_path / "nope", "--draft", draft, "w1"], "does not exist"
    if kind == "unknown draft":
        return ["generate", "--target", target, "--draft", tmp_path / "nope", "w1"], "does not exist"
    if kind == "hidden mismatch":
        d = write_deepspec_draft(tmp_path / "d", vocab=64, hidden=48, taps=(0, 1))
        return [*base[:4], d, *base[5:], "w1"], "hidden size"
    if kind == "vocab mismatch":
        d = write_deepspec_draft(tmp_path / "d", vocab=80, hidden=32, taps=(0, 1))
        return [*base[:4], d, *base[5:], "w1"], "vocabulary"
    if kind == "wrong tensor shape":
        d = write_deepspec_draft(tmp_path / "d", tensor_overrides={
            "layers.0.mlp.up_proj.weight": torch.zeros(10, 32, dtype=torch.bfloat16)})
        return [*base[:4], d, *base[5:], "w1"], "layers.0.mlp.up_proj.weight"
    if kind == "unexpected tensor":
        d = write_deepspec_draft(tmp_path / "d", tensor_overrides={"bogus.weight": torch.zeros(2)})
        return [*base[:4], d, *base[5:], "w1"], "bogus.weight"
    if kind == "tap beyond target":
        d = write_deepspec_draft(tmp_path / "d", taps=(0, 3), num_target_layers=4)
        return [*base[:4], d, *base[5:], "w1"], "taps target layer 3"
    if kind == "static beyond block":
        return [*base, "--policy", "static:9", "w1"], "block size"
    if kind == "unknown policy":
        return [*base, "--policy", "fastest", "w1"], "unknown policy"
    if kind == "empty prompt file":
        f = tmp_path / "p.txt"
        f.write_text("\n\n")
        return [*base, "--prompts-file", f], "no prompts"
    if kind == "empty jsonl row":
        f = tmp_path / "p.jsonl"
        f.write_text('{"prompt": "w1"}\n{"prompt": "  "}\n')
        return [*base, "--prompts-file", f], "row 2: empty prompt"
    if kind == "missing field":
        f = tmp_path / "p.jsonl"
        f.write_text('{"question": "w1"}\n')
        return [*base, "--prompts-file", f, "--field", "prompt"], "field 'prompt' is missing"
    if kind == "negative temperature":
        return [*base, "--temperature", "-1", "w1"], "--temperature must be"
    if kind == "top-p out of range":
        return [*base, "--top-p", "1.5", "w1"], "--top-p must be"
    if kind == "zero max tokens":
        return [*base[:-1], "0", "w1"], "max-new-tokens"
    if kind == "siblings while sampling":
        return [*base, "--siblings", "2", "--temperature", "0.7", "w1"], "only greedy decoding"
    if kind == "siblings not a count":
        return [*base, "--siblings", "many", "w1"], "neither auto nor a whole number"
    if kind == "siblings beside a trace":  # the test adds --trace to every case
        return [*base, "--siblings", "2", "w1"], "records the draft's chain"
    if kind == "dspark with a missing table":
        return [*base, "--policy", "dspark", "--sps-table", "/nonexistent/sps.json", "w1"], "does not exist"
    raise AssertionError(kind)


BAD = ["unknown target", "unknown draft", "hidden mismatch", "vocab mismatch", "wrong tensor shape",
       "unexpected tensor", "tap beyond target", "static beyond block", "unknown policy",
       "empty prompt file", "empty jsonl row", "missing field", "negative temperature",
       "top-p out of range", "zero max tokens", "dspark with a missing table", "siblings while sampling",
       "siblings not a count", "siblings beside a trace"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_input_one_line_error(models, tmp_path, kind):
    args, needle = _bad(tmp_path, models, kind)
    trace = tmp_path / "trace.jsonl"
    res = run(*args, "--trace", trace)
    assert res.exit_code != 0, res.output
    err_lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in err_lines if "error:" in ln]
    assert len(errors) == 1, res.stderr
    assert needle.lower() in errors[0].lower(), errors[0]
    assert "Traceback" not in res.output
    assert not trace.exists()


def test_profile_sps_then_scheduled_generation_then_calibration(models, tmp_path):
    """The whole loop a user runs: profile the engine, generate under a DSpark scheduler with a
    trace, calibrate the confidence head on that trace, then generate with the temperatures."""
    _, target, draft = models
    sps = tmp_path / "sps.json"
    res = run("profile-sps", "--target", target, "--draft", draft, "--out", sps, "--requests", "1,2", "--tokens-per-request",
              "1,3", "--repeats", 2, "--warmup", 1, "--context-len", 16, "--json")
    assert res.exit_code == 0, res.output
    prof = json.loads(res.stdout)
    assert prof["batch_tokens"] == [1, 2, 3, 6] and all(s > 0 for s in prof["steps_per_sec"])
    sg = json.loads((tmp_path / "sps.sglang.json").read_text())
    assert sg["sample_batch_tokens"] == [1, 2, 3, 6] and sg["max_batch_tokens"] >= 6
    assert (tmp_path / "sps.png").stat().st_size > 1000

    trace = tmp_path / "full.jsonl"
    res = run("generate", "--target", target, "--draft", draft, "--no-chat", "--max-new-tokens", 16,
              "--json", "--policy", "static:4", "--trace", trace, *[f"w{i} w{i + 1}" for i in range(3, 15)])
    assert res.exit_code == 0, res.output
    traced = json.loads(res.stdout)  # a trace runs without siblings and lookup: asked "auto", run off (hostile round 5)
    assert traced["siblings"]["setting"] == "auto" and traced["siblings"]["effective"] == 0
    assert traced["lookup"]["setting"] == "auto" and traced["lookup"]["effective"] is False
    calib = tmp_path / "calib.json"
    res = run("calibrate", trace, "--out", calib, "--holdout", 0.25, "--bins", 5)
    assert res.exit_code == 0, res.output
    for policy in ("dspark", "dspark-async", "survival:0.2"):
        res = run("generate", "--target", target, "--draft", draft, "--no-chat", "--max-new-tokens", 10,
                  "--policy", policy, "--sps-table", sps, "--calibration", calib, "--json", "w1 w2", "w3")
        assert res.exit_code == 0, (policy, res.output)
        rep = json.loads(res.stdout)
        assert rep["policy"] == policy and rep["engine_steps"] > 0
        # the draft's rounds, and the engine's plain steps beside them, account for every step's rows
        assert rep["acceptance"]["rounds"] + rep["engine"]["plain_rows"] >= rep["engine_steps"]


def test_draft_and_target_from_a_hub_over_loopback(models, tmp_path, monkeypatch):
    """`--draft org/name` and `--target org/name` are fetched through huggingface_hub from a real
    HTTP server on 127.0.0.1 that answers like the hub's resolve endpoint."""
    from huggingface_hub import constants

    from tests.test_checkpoint_hub import FakeHub

    _, target, draft = models
    hubs = {"draft": FakeHub(draft, repo="acme/tiny-dspark"), "target": FakeHub(target, repo="acme/tiny-target")}
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    try:
        monkeypatch.setenv("HF_ENDPOINT", hubs["draft"].url)
        res = run("generate", "--target", target, "--draft", "acme/tiny-dspark", "--no-chat",
                  "--max-new-tokens", 6, "--json", "w1 w2")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["draft"] == "acme/tiny-dspark"
        assert hubs["draft"].served >= (draft / "model.safetensors").stat().st_size
        monkeypatch.setenv("HF_ENDPOINT", hubs["target"].url)
        res = run("generate", "--target", "acme/tiny-target", "--draft", draft, "--no-chat",
                  "--max-new-tokens", 6, "--json", "w1 w2")
        assert res.exit_code == 0, res.output
        res = run("generate", "--target", "acme/missing", "--draft", draft, "w1")
        assert res.exit_code != 0 and "not found" in res.stderr
    finally:
        for h in hubs.values():
            h.server.shutdown()
