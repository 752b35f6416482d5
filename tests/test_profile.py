"""profile-sps measures the whole speculative step by default (what SGLang's table holds)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.engine.profile import SETTLE_TOKENS, profile_whole_step
from dsparkctl.engine.speculative import SpeculativeEngine
from dsparkctl.errors import UsageError
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.draft_io import random_draft
from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import save_tiny_target, tiny_target, write_deepspec_draft


def test_whole_step_points_roll_back_exactly():
    model = tiny_target("qwen3")
    tgt = TargetAdapter(model, [0, 1])
    draft = random_draft(tgt, block_size=4, markov_rank=8, layer_ids=[0, 1])
    eng = SpeculativeEngine(tgt, draft, parse_policy("static:4"), SamplingParams(0.0))
    seen = []
    points = profile_whole_step(eng, [1, 3], [1, 3, 5], context_len=16, repeats=2, warmup=1,
                                on_point=lambda p: seen.append((p.requests, p.tokens_per_request,
                                                                int(tgt.seq_len.max()), tgt.cache_slots())))
    assert [(p.requests, p.tokens_per_request, p.plain) for p in points] == [
        (1, 1, False), (1, 3, False), (1, 5, False), (1, 1, True), (3, 1, False), (3, 3, False), (3, 5, False),
        (3, 1, True)]  # the plain step (no draft) per request count
    assert all(len(p.ms) == 2 and min(p.ms) > 0 for p in points)
    for R in (1, 3):  # after the settling round, every probe rolls back: the cache never grew
        at = {(s[2], s[3]) for s in seen if s[0] == R}
        assert len(at) == 1 and 16 < min(at)[0] <= 16 + SETTLE_TOKENS and min(at)[1] >= min(at)[0]
    assert eng.policy.spec == "static:4"  # the engine's own policy is back after profiling
    with pytest.raises(UsageError, match="verifies more than"):
        profile_whole_step(eng, [1], [6], context_len=8)


def test_a_rewound_round_runs_again_identically():
    """`SpeculativeEngine.mark`: the profile times the engine's own round, then rewinds target,
    draft context and rows; the same round from the same state gives the same tokens and leaves
    the caches as the first did. Also after a plain step, whose draft update is deferred."""
    import torch

    from dsparkctl.engine.clock import Clock

    model = tiny_target("llama")
    tgt = TargetAdapter(model, [0, 1])
    draft = random_draft(tgt, block_size=4, markov_rank=8, layer_ids=[0, 1], seed=3)
    for spec in ("static:3", "static:0", "static:2"):
        eng = SpeculativeEngine(tgt, draft, parse_policy(spec), SamplingParams(0.0))
        live = eng.prefill([[5, 6, 7, 8, 9], [3, 4, 5, 1, 2]], 32, None)
        eng.round(live, 32, None, Clock(None))  # a state with history (and, after static:0, deferred context)
        rewind = eng.mark(live)
        runs = []
        for _ in range(2):
            rd = eng.round(live, 32, None, Clock(None))
            runs.append((rd.emitted.tolist(), rd.kept.tolist(), live.anchors.tolist(), live.produced.tolist(),
                         tgt.seq_len.tolist(), tgt.valid.clone(), live.context.ctx_len.tolist(),
                         len(live.context.pending)))
            rewind()
        assert runs[0][:5] == runs[1][:5] and torch.equal(runs[0][5], runs[1][5]) and runs[0][6:] == runs[1][6:], spec


def test_cli_default_is_whole_step_and_the_file_says_so(tmp_path):
    target = save_tiny_target(tmp_path / "t", "llama")
    draft = write_deepspec_draft(tmp_path / "d", block_size=3)
    out = tmp_path / "sps.json"
    fast = ["--requests", "1,2", "--repeats", "1", "--warmup", "0", "--context-len", "8"]
    res = CliRunner().invoke(app, ["profile-sps", "--target", str(target), "--draft", str(draft), "--out", str(out),
                                   *fast, "--json"])
    assert res.exit_code == 0, res.output
    ours = json.loads(out.read_text())
    assert ours["measures"] == "whole-step" and ours["draft"] == str(draft)
    assert ours["batch_tokens"] == [1, 2, 3, 4, 6, 8]  # tokens per request 1..γ+1 = 1..4, requests 1, 2
    res = CliRunner().invoke(app, ["profile-sps", "--target", str(target), "--measure", "target-forward",
                                   "--out", str(tmp_path / "tf.json"), *fast, "--tokens-per-request", "1,2"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "tf.json").read_text())["measures"] == "target-forward"
    sg = json.loads((tmp_path / "tf.sglang.json").read_text())
    assert set(sg) == {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}


def test_one_probe_grids_are_refused_before_loading(tmp_path):
    res = CliRunner().invoke(app, ["profile-sps", "--target", str(tmp_path / "none"), "--requests", "2",
                                   "--tokens-per-request", "1", "--out", str(tmp_path / "s.json")])
    assert res.exit_code != 0 and "one batch-token count" in res.output and not (tmp_path / "s.json").exists()
