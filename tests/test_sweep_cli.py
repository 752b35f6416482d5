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


@pytest.mark.slow  # ~5 s
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
