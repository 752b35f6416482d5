"""CLI for calibrate / sweep-scheduler / audit, driven in-process; bad inputs table-driven."""

import json

import pytest
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.math.sps import SPSTable
from dsparkctl.math.synthetic import SyntheticModel
from dsparkctl.sps_io import save_sps_table
from dsparkctl.trace import write_synthetic_trace

runner = CliRunner()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("sched")
    write_synthetic_trace(d / "full.jsonl", SyntheticModel(), 60, 20, seed=1)
    write_synthetic_trace(d / "partial.jsonl", SyntheticModel(), 10, 5, seed=2, verify_length=2)
    write_synthetic_trace(d / "noconf.jsonl", SyntheticModel(), 10, 5, seed=3, with_confidence=False)
    g3 = SyntheticModel(gamma=3, mean_logit=(2.0, 1.5, 1.0), overconfidence=(2.0,) * 3, bias=(0.0,) * 3)
    write_synthetic_trace(d / "g3.jsonl", g3, 10, 5, seed=4)
    save_sps_table(SPSTable([1, 4, 16, 64, 256, 1024, 8192], [50.0, 40.0, 35.0, 25.0, 12.0, 4.0, 0.6]), d / "sps.json")
    save_sps_table(SPSTable([1, 4, 16], [50.0, 40.0, 35.0]), d / "sps_sglang.json", fmt="sglang")
    (d / "bad_sps.json").write_text(json.dumps({"sample_batch_tokens": [1, 8, 4],
                                                "sample_steps_per_sec": [3, 2, 1], "max_batch_tokens": 8}))
    lines = (d / "full.jsonl").read_text().splitlines()
    lines[3] = lines[3].replace('"accepted"', '"acceptd"')
    (d / "malformed.jsonl").write_text("\n".join(lines) + "\n")
    (d / "notjson.jsonl").write_text(lines[0] + "\n{oops\n")
    return d


def test_calibrate_writes_all_outputs(files, tmp_path):
    res = runner.invoke(app, ["calibrate", str(files / "full.jsonl"), "--out", str(tmp_path / "c.json"),
                              "--bins", "10", "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["format"] == "dsparkctl-calibration/1" and len(obj["temperatures"]) == 5
    ours = json.loads((tmp_path / "c.json").read_text())
    assert "provenance" in ours and ours["metrics_heldout"]["before"][0]["diagram"]["count"]
    sg = json.loads((tmp_path / "c.sglang-sts.json").read_text())
    assert set(sg) == {"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}
    assert all(t > 0 for t in sg["temperatures"])
    assert len(list((tmp_path / "c_reliability").glob("reliability_pos*.png"))) == 5


def test_sweep_json_and_plot(files, tmp_path):
    res = runner.invoke(app, ["sweep-scheduler", "--trace", str(files / "full.jsonl"),
                              "--sps-table", str(files / "sps.json"), "--policies", "static:1,dspark,dspark-async",
                              "--concurrency", "1,4,64", "--rounds", "500", "--plot", str(tmp_path / "f.png"),
                              "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    rows = doc["rows"]
    assert [(r["policy"], r["concurrency"]) for r in rows] == [
        (p, c) for c in (1, 4, 64) for p in ("static:1", "dspark", "dspark-async")]
    assert doc["pooled_rounds"] == 60 * 20 and doc["block_size"] == 5
    for r in rows:  # each cell replays ceil(rounds / C) steps of C requests
        assert r["steps"] == -(-500 // r["concurrency"]) and r["request_rounds"] == r["steps"] * r["concurrency"]
        assert r["per_user_tok_s"] == pytest.approx(r["throughput_tok_s"] / r["concurrency"])
        assert 0.0 <= r["mean_verify"] <= 5.0 and 1.0 <= r["tokens_per_step"] <= 1.0 + r["mean_verify"]
    # static:1 verifies one draft per request: B = 2C every step, so each step takes 1 / SPS(2C) with the
    # table's floor lookup (C=1: B=2 -> 50/s; C=4: B=8 -> 40/s; C=64: B=128 -> 25/s)
    for r in (r for r in rows if r["policy"] == "static:1"):
        sps = {1: 50.0, 4: 40.0, 64: 25.0}[r["concurrency"]]
        assert r["mean_verify"] == 1.0 and r["mean_batch_tokens"] == 2 * r["concurrency"]
        assert r["throughput_tok_s"] == pytest.approx(r["tokens_per_step"] * r["concurrency"] * sps)
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_accepts_sglang_table_and_static_without_confidence(files):
    res = runner.invoke(app, ["sweep-scheduler", "--trace", str(files / "noconf.jsonl"),
                              "--sps-table", str(files / "sps_sglang.json"), "--policies", "static:2",
                              "--concurrency", "2", "--rounds", "50", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["pooled_rounds"] == 10 * 5 and doc["temperatures"] is None
    (r,) = doc["rows"]
    assert (r["policy"], r["concurrency"], r["steps"], r["request_rounds"]) == ("static:2", 2, 25, 50)
    assert r["mean_verify"] == 2.0 and r["mean_batch_tokens"] == 6.0  # B = 2 requests × (1 + 2)
    assert 1.0 <= r["tokens_per_step"] <= 3.0
    # the SGLang table's probes 1, 4, 16 -> 50, 40, 35 steps/s: B = 6 reads the probe at 4 (floor, SGLang's
    # lookup), so 25 steps take 25/40 s
    assert r["throughput_tok_s"] == pytest.approx(r["tokens_per_step"] * 50 / (25 / 40.0))


def test_audit_command(tmp_path):
    res = runner.invoke(app, ["audit", "--policies", "retrospective,dspark", "--rounds", "20000",
                              "--random-settings", "1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    a = {r["policy"]: r for r in out["results"] if r["setting"] == "appendix-a"}
    assert a["retrospective"]["verdict"] == "FAIL" and a["dspark"]["verdict"] == "pass"
    assert out["unexpected_failures"] == 0


BAD = [
    ("malformed trace line", ["calibrate", "{d}/malformed.jsonl", "--out", "{o}/c.json"],
     "malformed.jsonl:4: missing field(s) accepted"),
    ("not JSON", ["calibrate", "{d}/notjson.jsonl", "--out", "{o}/c.json"], "notjson.jsonl:2: not valid JSON"),
    ("no confidence", ["calibrate", "{d}/noconf.jsonl", "--out", "{o}/c.json"], "has no confidence logits"),
    ("bad holdout", ["calibrate", "{d}/full.jsonl", "--holdout", "1.5", "--out", "{o}/c.json"], "--holdout"),
    ("sps not increasing", ["sweep-scheduler", "--trace", "{d}/full.jsonl", "--sps-table", "{d}/bad_sps.json",
                            "--out", "{o}/s.json"], "not strictly increasing"),
    ("wrong block size", ["sweep-scheduler", "--trace", "{d}/full.jsonl", "--sps-table", "{d}/sps.json",
                          "--calibration", "{o}/g3calib.json", "--out", "{o}/s.json"],
     "temperatures are for block size 3 but the traces have block size 5"),
    ("unknown policy", ["sweep-scheduler", "--trace", "{d}/full.jsonl", "--sps-table", "{d}/sps.json",
                        "--policies", "dspark,greedy-magic", "--out", "{o}/s.json"], "unknown policy 'greedy-magic'"),
    ("partial verification", ["sweep-scheduler", "--trace", "{d}/partial.jsonl", "--sps-table", "{d}/sps.json",
                              "--out", "{o}/s.json"], "needs traces recorded with full verification"),
    ("confidence policy on noconf", ["sweep-scheduler", "--trace", "{d}/noconf.jsonl", "--sps-table",
                                     "{d}/sps.json", "--policies", "dspark", "--out", "{o}/s.json"],
     "need confidence logits"),
    ("bad concurrency", ["sweep-scheduler", "--trace", "{d}/full.jsonl", "--sps-table", "{d}/sps.json",
                         "--concurrency", "1,x", "--out", "{o}/s.json"], "--concurrency"),
    ("one-token batches", ["sweep-scheduler", "--trace", "{d}/full.jsonl", "--sps-table", "{d}/sps.json",
                           "--max-new-tokens", "1", "--out", "{o}/s.json"], "--max-new-tokens"),
    ("audit unknown policy", ["audit", "--policies", "nope"], "unknown policy 'nope'"),
    ("missing trace", ["calibrate", "{d}/nothere.jsonl", "--out", "{o}/c.json"], "does not exist"),
]


@pytest.mark.parametrize("name,argv,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_line_nonzero_nothing_written(files, tmp_path, name, argv, msg):
    if name == "wrong block size":
        r = runner.invoke(app, ["calibrate", str(files / "g3.jsonl"), "--out", str(tmp_path / "g3calib.json")])
        assert r.exit_code == 0, r.output
    before = set(tmp_path.rglob("*"))
    res = runner.invoke(app, [a.format(d=files, o=tmp_path) for a in argv])
    assert res.exit_code != 0
    text = res.stderr.strip() if res.stderr else res.output.strip()
    assert msg in " ".join(text.split()), text
    assert text.count("error:") == 1 and "Traceback" not in text, text  # one message (rich may wrap it)
    assert set(tmp_path.rglob("*")) == before  # nothing written


def _pool(accepted: list[int], gamma: int = 3) -> dict:
    import torch

    n = len(accepted)
    logits = torch.linspace(-2.0, 2.0, n * gamma, dtype=torch.float64).view(n, gamma)
    return {"logits": logits, "accepted": torch.tensor(accepted), "gamma": gamma, "has_confidence": True, "skipped": 0}


def _grid_table(verify: str) -> SPSTable:
    from dsparkctl.math.sps import StepGrid

    grid = StepGrid([1, 4], [1, 2, 3, 4], [[10.0, 20.0, 30.0, 40.0]] * 2, [8.0, 8.0], verify=verify)
    return SPSTable([1, 2], [1.0, 1.0], grid=grid)


def test_replay_prices_a_step_as_the_engine_lays_it_out():
    """Fixed lengths cost the same in both layouts; a policy whose lengths differ across requests
    pays for its longest verify on a padded table (dsparkctl's engine), not on a ragged one."""
    from dsparkctl.sweep import replay

    pool = _pool([0, 1, 2, 3] * 50)
    padded, ragged = ({r["policy"]: r for r in replay(pool, ["static:2", "threshold:0.5"], [4], t, rounds=2000)}
                      for t in (_grid_table("padded"), _grid_table("ragged")))
    assert padded["static:2"]["throughput_tok_s"] == pytest.approx(ragged["static:2"]["throughput_tok_s"])
    assert padded["threshold:0.5"]["throughput_tok_s"] < ragged["threshold:0.5"]["throughput_tok_s"]
    assert padded["threshold:0.5"]["mean_batch_tokens"] > ragged["threshold:0.5"]["mean_batch_tokens"]


@pytest.mark.parametrize("k,C,N", [(1, 1, 16), (2, 4, 16), (3, 3, 9), (0, 2, 5)])
def test_batch_replay_runs_each_request_to_its_token_budget(k, C, N):
    """Every draft accepted: a request needs N - 1 tokens after the first, static:k emits k + 1 per
    step (the last step capped by the budget), so a batch takes ceil((N-1)/(k+1)) steps of
    10·(k'+1) ms (a plain step 8 ms for static:0) and decodes C·(N-1) tokens."""
    from math import ceil

    from dsparkctl.sweep import replay_batches

    row = replay_batches(_pool([3] * 10), [f"static:{k}"], [C], _grid_table("padded"), N, rounds=C * (N - 1))[0]
    steps = ceil((N - 1) / (k + 1))
    ms = [8.0] * steps if k == 0 else [10.0 * (min(k, N - 2 - i * (k + 1)) + 1) for i in range(steps)]
    assert row["batches"] == 1 and row["steps"] == steps
    assert row["throughput_tok_s"] == pytest.approx(C * (N - 1) / (sum(ms) / 1000.0))
    assert row["drafted_share"] == (0.0 if k == 0 else 1.0)


def test_sweep_replays_finite_batches_on_request(files):
    res = runner.invoke(app, ["sweep-scheduler", "--trace", str(files / "full.jsonl"), "--sps-table", str(files / "sps.json"),
                              "--policies", "static:0,static:2,dspark", "--concurrency", "1,4", "--rounds", "300",
                              "--max-new-tokens", "24", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["mode"] == "batches" and doc["max_new_tokens"] == 24 and doc["verify_layout"] == "ragged"
    assert {(r["policy"], r["concurrency"]) for r in doc["rows"]} == {
        (p, c) for p in ("static:0", "static:2", "dspark") for c in (1, 4)}
    assert all(r["max_new_tokens"] == 24 and r["throughput_tok_s"] > 0 for r in doc["rows"])
