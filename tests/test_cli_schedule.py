"""The scheduling commands (cli/schedule.py: `calibrate`, `sweep-scheduler`, `audit`). Hostile inputs
(issue 12): each case exits non-zero with one line naming the file (and line) or the option, no
traceback, and no file of the user's left, created or changed. Below the table: what must come out
right instead of failing; then the commands driven in-process on good inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.formats.sps import save_sps_table
from dsparkctl.formats.trace import write_synthetic_trace
from dsparkctl.math.sps import SPSTable
from dsparkctl.math.synthetic import SyntheticModel
from dsparkctl.strict_json import loads
from tests.helpers import snapshot

runner = CliRunner()
SPS = {"format": "dsparkctl-sps/1", "batch_tokens": [1, 4, 16, 64, 256, 1024, 8192],
       "steps_per_sec": [50.0, 40.0, 35.0, 25.0, 12.0, 4.0, 0.6]}


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _row(lines: list[str], i: int = 1, **changes) -> str:
    return json.dumps({**json.loads(lines[i]), **changes})


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    """Every input file of the table: a valid trace and table, and one broken variant each."""
    d = tmp_path_factory.mktemp("inputs")
    write_synthetic_trace(d / "full.jsonl", SyntheticModel(), 40, 10, seed=1)
    write_synthetic_trace(d / "noconf.jsonl", SyntheticModel(), 10, 5, seed=3, with_confidence=False)
    L = _lines(d / "full.jsonl")
    text = {
        "nonutf8.jsonl": "\n".join(L[:2]) + "\n" + L[2][:-1] + "\udcff}\n" + "\n".join(L[3:]),
        "bigreq.jsonl": "\n".join([L[0], _row(L, request=10 ** 30), *L[2:]]),
        "dupline.jsonl": "\n".join(L + [L[7]]),
        "dupkey.jsonl": "\n".join([L[0], L[1][:-1] + ', "accepted": 0}', *L[2:]]),
        "nanlogit.jsonl": "\n".join([L[0], _row(L, confidence_logits=[0.1] * 4 + [float("nan")]), *L[2:]]),
        "overflow.jsonl": "\n".join([L[0], _row(L).replace('"draft_ms": 1.0', '"draft_ms": 1e400'), *L[2:]]),
        "capflag.jsonl": "\n".join([L[0], _row(L, budget_capped="yes"), *L[2:]]),
        "hugeblock.jsonl": "\n".join([L[0], _row(L, block_size=10 ** 9, verify_length=10 ** 9, confidence_logits=None),
                                      *L[2:]]),
        "notrace.jsonl": '{"format": "something-else"}\n',
        "empty.jsonl": "",
        # the last round of each request shortened by --max-new-tokens, not marked (an older engine)
        "unmarked.jsonl": "\n".join([L[0]] + [_row(L, i, verify_length=2, accepted=min(2, json.loads(L[i])["accepted"]))
                                              if i % 10 == 0 else L[i] for i in range(1, len(L))]),
        "allcapped.jsonl": "\n".join([L[0]] + [_row(L, i, verify_length=1, accepted=0, budget_capped=True)
                                               for i in range(1, 6)]),
        "sps_nan.json": json.dumps(SPS).replace("50.0", "NaN"),
        "sps_inf.json": json.dumps(SPS).replace("50.0", "Infinity"),
        "sps_str.json": json.dumps({**SPS, "steps_per_sec": ["50", *SPS["steps_per_sec"][1:]]}),
        "sps_1e308.json": json.dumps({**SPS, "steps_per_sec": [1e308, *SPS["steps_per_sec"][1:]]}),
        "sps_bt1e308.json": json.dumps({**SPS, "batch_tokens": [*SPS["batch_tokens"][:-1], 1e308]}),
        "sps_mbt.json": json.dumps({**SPS, "max_batch_tokens": "100000"}),
        "sps_lookup.json": json.dumps({**SPS, "lookup": 5}),
        "sps_extrap.json": json.dumps({**SPS, "extrapolate": "cubic"}),
        "sps_dupkey.json": json.dumps(SPS)[:-1] + ', "steps_per_sec": [1, 2, 3, 4, 5, 6, 7]}',
        "sps_small_error.json": json.dumps({**SPS, "batch_tokens": [1, 2, 3], "steps_per_sec": [3.0, 2.0, 1.0],
                                            "extrapolate": "error"}),
        "sps_sglang_bool.json": json.dumps({"sample_batch_tokens": [1, 2], "sample_steps_per_sec": [2.0, 1.0],
                                            "max_batch_tokens": True}),
        "calib_nan.json": '{"temperatures": [1, 1, 1, 1, NaN]}',
        "calib_dup.json": '{"temperatures": [1, 1, 1, 1, 1], "temperatures": [2, 2, 2, 2, 2]}',
    }
    for name, body in text.items():
        (d / name).write_bytes(body.encode("utf-8", "surrogateescape"))
    (d / "sps.json").write_text(json.dumps(SPS))
    (d / "sps_notutf8.json").write_bytes(b'{"format": "dsparkctl-sps/1", "x": "\xff"}')
    (d / "a_folder").mkdir()
    (d / "a_file").write_text("the user's file")
    return d


CAL = ["calibrate", "{d}/full.jsonl"]
SWEEP = ["sweep-scheduler", "--trace", "{d}/full.jsonl", "--sps-table", "{d}/sps.json", "--rounds", "2000",
         "--concurrency", "1,8"]
AUDIT = ["audit", "--rounds", "1000", "--random-settings", "0", "--policies", "dspark"]


def _sweep(*extra: str, trace: str = "full.jsonl", sps: str = "sps.json") -> list[str]:
    argv = [a.replace("full.jsonl", trace).replace("sps.json", sps) for a in SWEEP]
    return [*argv, *extra]


# (case, argv with {d} = inputs and {o} = an output folder of the user's, text of the one line)
CASES = [
    # calibrate: every output checked before the traces are read
    ("calibrate --out a folder", [*CAL, "--out", "{d}/a_folder"], "--out {d}/a_folder is a folder"),
    ("calibrate --sglang-out a folder", [*CAL, "--out", "{o}/c.json", "--sglang-out", "{d}/a_folder"],
     "--sglang-out {d}/a_folder is a folder"),
    ("calibrate --plot-dir a file", [*CAL, "--out", "{o}/c.json", "--plot-dir", "{d}/a_file"],
     "--plot-dir {d}/a_file exists and is not a folder"),
    ("calibrate --out below a file", [*CAL, "--out", "{d}/a_file/c.json"], "{d}/a_file is not a folder"),
    ("calibrate --out = the trace", [*CAL, "--out", "{d}/full.jsonl"], "is one of the inputs"),
    ("calibrate --out ''", [*CAL, "--out", ""], "--out is empty"),
    ("calibrate --out = --sglang-out", [*CAL, "--out", "{o}/c.json", "--sglang-out", "{o}/c.json"],
     "is the same path as --out"),
    # calibrate: sizes bounded by the data, values checked
    ("calibrate --bins 100000000", [*CAL, "--out", "{o}/c.json", "--bins", "100000000"],
     "--bins 100000000 is more than the 400 rounds"),
    ("calibrate --bins 1", [*CAL, "--out", "{o}/c.json", "--bins", "1"], "--bins must be ≥ 2"),
    ("calibrate --holdout nan", [*CAL, "--out", "{o}/c.json", "--holdout", "nan"], "--holdout"),
    ("calibrate --seed 2**70", [*CAL, "--out", "{o}/c.json", "--seed", str(2 ** 70)], "--seed"),
    ("calibrate the same trace twice", ["calibrate", "{d}/full.jsonl", "{d}/full.jsonl", "--out", "{o}/c.json"],
     "is given twice"),
    # trace reader
    ("trace: non-UTF-8 byte", ["calibrate", "{d}/nonutf8.jsonl", "--out", "{o}/c.json"],
     "nonutf8.jsonl:3: not UTF-8 (byte 0xff"),
    ("trace: request 10**30", ["calibrate", "{d}/bigreq.jsonl", "--out", "{o}/c.json"],
     "bigreq.jsonl:2: field 'request' must be an integer in [0, 2^63)"),
    ("trace: duplicated row", ["calibrate", "{d}/dupline.jsonl", "--out", "{o}/c.json"],
     "dupline.jsonl:402: request 0 round 6 is already on line 8"),
    ("trace: key twice in a row", ["calibrate", "{d}/dupkey.jsonl", "--out", "{o}/c.json"],
     "dupkey.jsonl:2: duplicate key 'accepted'"),
    ("trace: NaN logit", ["calibrate", "{d}/nanlogit.jsonl", "--out", "{o}/c.json"],
     "nanlogit.jsonl:2: NaN is not a JSON number"),
    ("trace: 1e400", ["calibrate", "{d}/overflow.jsonl", "--out", "{o}/c.json"], "overflow.jsonl:2: 1e400 overflows"),
    ("trace: budget_capped not a bool", _sweep(trace="capflag.jsonl"),
     "capflag.jsonl:2: field 'budget_capped' must be true or false"),
    ("trace: block_size 10**9", _sweep(trace="hugeblock.jsonl"), "hugeblock.jsonl:2: block_size must be in [1, 256]"),
    ("trace: not a trace", ["calibrate", "{d}/notrace.jsonl", "--out", "{o}/c.json"], "notrace.jsonl is a 'something-else' document, not a trace"),
    ("trace: empty", ["calibrate", "{d}/empty.jsonl", "--out", "{o}/c.json"], "empty.jsonl is empty"),
    ("trace: a folder", ["calibrate", "{d}/a_folder", "--out", "{o}/c.json"], "a_folder is not a regular file"),
    ("trace: missing", ["calibrate", "{d}/nothere.jsonl", "--out", "{o}/c.json"], "nothere.jsonl does not exist"),
    ("trace: no confidence", ["calibrate", "{d}/noconf.jsonl", "--out", "{o}/c.json"], "has no confidence logits"),
    # sweep-scheduler: options
    ("sweep --policies ''", _sweep("--policies", ""), "--policies '' names no policy"),
    ("sweep static:K past the block size (hostile round 5)", _sweep("--policies", "static:9"),
     "verifies 9 drafts but the draft's block size is"),
    ("sweep --policies ' , '", _sweep("--policies", " , "), "names no policy"),
    ("sweep threshold:nan", _sweep("--policies", "threshold:nan"), "policy 'threshold:nan'"),
    ("sweep survival:inf", _sweep("--policies", "survival:inf"), "policy 'survival:inf'"),
    ("sweep static:-1", _sweep("--policies", "static:-1"), "policy 'static:-1'"),
    ("sweep --concurrency beyond --rounds", _sweep("--concurrency", "1,50000"),
     "--concurrency 50000 is more than --rounds 2000"),
    ("sweep --concurrency beyond any load", _sweep("--concurrency", "1,1000000000"),
     "--concurrency 1000000000 is larger than 65536"),
    ("sweep --rounds 0", _sweep("--rounds", "0"), "--rounds must be ≥ 1"),
    ("sweep --rounds 10**9", _sweep("--rounds", str(10 ** 9)), "--rounds 1000000000 × block size 5"),
    ("sweep --seed -1", _sweep("--seed", "-1"), "--seed -1"),
    ("sweep --plot j.xyz", _sweep("--plot", "{o}/j.xyz", "--out", "{o}/s.json"), "cannot write figures of type '.xyz'"),
    ("sweep --out a folder", _sweep("--out", "{d}/a_folder"), "--out {d}/a_folder is a folder"),
    ("sweep --out = --plot", _sweep("--out", "{o}/f.png", "--plot", "{o}/f.png"), "is the same path"),
    ("sweep --out = the SPS table", _sweep("--out", "{d}/sps.json"), "is one of the inputs"),
    # sweep-scheduler: SPS tables
    ("sps NaN", _sweep(sps="sps_nan.json"), "sps_nan.json: NaN is not a JSON number"),
    ("sps Infinity", _sweep(sps="sps_inf.json"), "sps_inf.json: Infinity is not a JSON number"),
    ("sps a string", _sweep(sps="sps_str.json"), "sps_str.json: steps_per_sec[0] = '50'"),
    ("sps 1e308 steps/s", _sweep(sps="sps_1e308.json"),
     "sps_1e308.json: steps_per_sec[0] = 1e+308 is not a positive finite number in [1e-06, 1e+09]"),
    ("sps 1e308 batch tokens", _sweep(sps="sps_bt1e308.json"), "sps_bt1e308.json: batch_tokens[6] = 1e+308"),
    ("sps max_batch_tokens a string", _sweep(sps="sps_mbt.json"), "sps_mbt.json: max_batch_tokens '100000'"),
    ("sps SGLang max_batch_tokens true", _sweep(sps="sps_sglang_bool.json"),
     "sps_sglang_bool.json: max_batch_tokens True"),
    ("sps lookup 5", _sweep(sps="sps_lookup.json"), "sps_lookup.json: field 'lookup' is 5"),
    ("sps extrapolate cubic", _sweep(sps="sps_extrap.json"), "sps_extrap.json: field 'extrapolate' is 'cubic'"),
    ("sps key twice", _sweep(sps="sps_dupkey.json"), "sps_dupkey.json: duplicate key 'steps_per_sec'"),
    ("sps not UTF-8", _sweep(sps="sps_notutf8.json"), "sps_notutf8.json: not UTF-8"),
    ("sps a folder", _sweep(sps="a_folder"), "a_folder is not a regular file"),
    ("sps beyond the last probe", _sweep("--policies", "static:5", sps="sps_small_error.json"),
     "sps_small_error.json: batch of 6 tokens is beyond the table's last probe (3)"),
    # sweep-scheduler: traces and calibration
    ("sweep the same trace twice", [*_sweep(), "--trace", "{d}/full.jsonl"], "is given twice"),
    ("sweep unmarked shortened rounds", _sweep(trace="unmarked.jsonl"), "not marked budget_capped"),
    ("sweep only budget-capped rounds", _sweep(trace="allcapped.jsonl"), "5 budget-capped"),
    ("calibration NaN", _sweep("--calibration", "{d}/calib_nan.json"), "calib_nan.json: NaN is not a JSON number"),
    ("calibration key twice", _sweep("--calibration", "{d}/calib_dup.json"), "duplicate key 'temperatures'"),
    # audit
    ("audit --alpha 0", [*AUDIT, "--alpha", "0"], "--alpha 0.0 must be in (0, 1)"),
    ("audit --alpha -1", [*AUDIT, "--alpha", "-1"], "--alpha -1.0 must be in (0, 1)"),
    ("audit --alpha nan", [*AUDIT, "--alpha", "nan"], "--alpha must be a finite number, got nan"),
    ("audit --alpha 1", [*AUDIT, "--alpha", "1"], "--alpha 1.0 must be in (0, 1)"),
    ("audit --random-settings -3", [*AUDIT, "--random-settings", "-3"], "--random-settings -3 is negative"),
    ("audit --rounds huge", [*AUDIT, "--rounds", "99999999999"], "--rounds 99,999,999,999 is more than 100,000,000"),
    ("audit --random-settings huge", [*AUDIT, "--random-settings", "99999999999"], "is more than 10,000"),
    ("audit --policies ''", ["audit", "--policies", "", "--rounds", "1000"], "--policies '' names no policy"),
    ("audit threshold:nan", ["audit", "--policies", "threshold:nan", "--rounds", "1000"], "policy 'threshold:nan'"),
    ("audit --rounds 10", ["audit", "--rounds", "10"], "--rounds 10 is too few"),
    ("audit --seed 2**70", [*AUDIT, "--seed", str(2 ** 70)], "--seed"),
]
HINT_NAMES_NO_MISSING_FLAG = ("--sps-extrapolate",)


@pytest.mark.parametrize("case,argv,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, argv, needle, d: Path, tmp_path: Path, monkeypatch):
    o = tmp_path / "mine"
    o.mkdir()
    (o / "notes.txt").write_text("the user's")
    monkeypatch.chdir(o)  # default outputs (calib.json, ...) would land here
    before = snapshot(d, o)
    res = runner.invoke(app, [a.format(d=d, o=o) for a in argv])
    message = res.stderr.strip()
    assert res.exit_code not in (0, None), f"{case}: exit 0\n{res.stdout[:300]}"
    assert len(message.splitlines()) == 1, f"{case}: not one line: {message!r}"
    assert message.startswith("error:") and "Traceback" not in res.output, message
    assert needle.format(d=d, o=o) in message, f"{case}: {needle!r} not in {message!r}"
    assert not any(flag in message for flag in HINT_NAMES_NO_MISSING_FLAG), message
    assert snapshot(d, o) == before, f"{case}: files left or changed"


# --------------------------------------------------------------------------- right results, not errors
def test_linear_extrapolation_never_runs_away():
    """A step time that falls between the last two probes would reach zero: it is held instead."""
    falling = SPSTable([1, 64], [10.0, 20.0], extrapolate="linear")
    assert falling.sps([64.0, 1e3, 1e6, 2.0 ** 31]).tolist() == [20.0, 20.0, 20.0, 20.0]
    rising = SPSTable([1, 64], [20.0, 10.0], extrapolate="linear")
    far = rising.sps([128.0, 1e6]).tolist()
    assert 0 < far[1] < far[0] < 10.0


def test_json_out_is_strict_and_files_are_strict(d: Path, tmp_path: Path):
    """Empty reliability bins and one-class AUROCs are NaN inside; --json and files show null."""
    res = runner.invoke(app, ["calibrate", str(d / "full.jsonl"), "--out", str(tmp_path / "c.json"), "--bins", "200",
                              "--json"])
    assert res.exit_code == 0, res.output
    loads(res.stdout)  # raises on NaN/Infinity
    for f in ("c.json", "c.sglang-sts.json"):
        loads((tmp_path / f).read_bytes())
    assert None in loads((tmp_path / "c.json").read_bytes())["metrics_heldout"]["before"][0]["diagram"]["mean_pred"]
    res = runner.invoke(app, [a.format(d=d) for a in _sweep("--json")])
    assert res.exit_code == 0, res.output
    doc = loads(res.stdout)
    assert doc["budget_capped_rounds_skipped"] == 0 and len(doc["rows"]) == 2 * 8  # 8 default policies
    res = runner.invoke(app, [*AUDIT, "--json"])
    assert res.exit_code == 0, res.output
    loads(res.stdout)


@pytest.mark.slow  # ~4 s
def test_calibrate_memory_is_bounded_by_the_data(d: Path, tmp_path: Path):
    """Peak RSS of calibrate with absurd --bins (refused) and with the most bins the data allows."""
    code = ("import resource, sys, typer; from dsparkctl.cli import schedule; app = typer.Typer(); "
            "schedule.register(app)\n"
            "try: app()\nexcept SystemExit as e: code = e.code\n"
            "print('PEAK_MB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, file=sys.stderr); "
            "sys.exit(code)")
    peaks = {}
    for bins in ("100000000", "400"):
        p = subprocess.run([sys.executable, "-c", code, "calibrate", str(d / "full.jsonl"), "--bins", bins,
                            "--out", str(tmp_path / f"c{bins}.json")], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[1], timeout=300)
        peaks[bins] = int(p.stderr.rsplit("PEAK_MB", 1)[1].split()[0])
        assert (p.returncode != 0) == (bins == "100000000"), p.stderr
    print(f"\ncalibrate peak RSS: --bins 1e8 (refused) {peaks['100000000']} MB, --bins 400 {peaks['400']} MB")
    assert max(peaks.values()) < 1500  # was 24 GB and killed before


def test_generate_trace_capped_by_the_budget_is_swept(tmp_path: Path):
    """`generate --max-new-tokens 12 --trace` marks the rounds the budget shortened; the sweep skips them."""
    from tests.tiny_models import save_tiny_target, write_deepspec_draft

    target = save_tiny_target(tmp_path / "target", "qwen3", vocab=64, layers=4)
    draft = write_deepspec_draft(tmp_path / "draft", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4)
    trace = tmp_path / "t.jsonl"
    res = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--no-chat",
                              "--max-new-tokens", "12", "--json", "--policy", "static:4", "--trace", str(trace),
                              *[f"w{i} w{i + 1}" for i in range(3, 11)]])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    capped = [r for r in rows if r["budget_capped"]]
    assert capped and all(r["verify_length"] < r["block_size"] for r in capped)
    assert all(r["verify_length"] == r["block_size"] for r in rows if not r["budget_capped"])
    (tmp_path / "sps.json").write_text(json.dumps(SPS))
    res = runner.invoke(app, ["sweep-scheduler", "--trace", str(trace), "--sps-table", str(tmp_path / "sps.json"),
                              "--policies", "static:1,static:4,dspark", "--concurrency", "1,4", "--rounds", "200",
                              "--json"])
    assert res.exit_code == 0, res.output
    doc = loads(res.stdout)
    assert doc["budget_capped_rounds_skipped"] == len(capped)
    assert doc["pooled_rounds"] == len(rows) - len(capped)


def test_library_errors_name_no_flags(d: Path):
    """The library says what is wrong in its own words; only the CLI names its flags (the table above)."""
    from dsparkctl.errors import UsageError
    from dsparkctl.math.audit import check_alpha
    from dsparkctl.tuning.calibration import calibrate_traces
    from dsparkctl.tuning.sweep import sweep_traces

    cases = [
        (lambda: sweep_traces([d / "full.jsonl"], d / "sps.json", rounds=0), "rounds must be ≥ 1, got 0"),
        (lambda: sweep_traces([d / "full.jsonl"], d / "sps.json", concurrency=[64], rounds=10),
         "concurrency 64 is more than rounds 10"),
        (lambda: calibrate_traces([d / "full.jsonl"], holdout=1.5), "holdout must be in (0, 1), got 1.5"),
        (lambda: calibrate_traces([d / "full.jsonl"], bins=10 ** 8), "bins 100000000 is more than the 400 rounds"),
        (lambda: check_alpha(0.0), "the significance level alpha 0.0 must be in (0, 1)"),
    ]
    for call, words in cases:
        with pytest.raises(UsageError) as e:
            call()
        assert words in e.value.message and "--" not in e.value.one_line(), e.value.one_line()


# -------- the commands driven in-process: calibrate, sweep-scheduler, audit
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
    from dsparkctl.tuning.sweep import replay

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

    from dsparkctl.tuning.sweep import replay_batches

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


# -------- the library entries (run_calibrate, run_sweep_scheduler, run_audit) and the human views
def test_human_views_print_a_table(files, tmp_path):
    """Without --json each command prints its table (built from the entry's document alone)."""
    cal = runner.invoke(app, ["calibrate", str(files / "full.jsonl"), "--out", str(tmp_path / "c.json"), "--bins", "10"])
    assert cal.exit_code == 0, cal.output
    assert "STS held-out survival metrics" in cal.stdout and "10 bins" in cal.stdout
    assert f"wrote {tmp_path / 'c.json'}" in cal.stderr
    sw = runner.invoke(app, ["sweep-scheduler", "--trace", str(files / "full.jsonl"), "--sps-table",
                             str(files / "sps.json"), "--policies", "static:1", "--concurrency", "1,4", "--rounds", "300",
                             "--out", str(tmp_path / "s.json")])
    assert sw.exit_code == 0, sw.output
    assert "300 request-rounds per cell" in sw.stdout and f"wrote {tmp_path / 's.json'}" in sw.stderr
    au = runner.invoke(app, ["audit", "--policies", "retrospective,static:1", "--rounds", "1000", "--plain-rounds",
                             "1000", "--random-settings", "0"])
    assert au.exit_code == 0, au.output  # the biased policy fails as expected: no unexpected failure
    assert "FAIL*" in au.stdout and "biased, as expected" in au.stdout and "pass" in au.stdout


def test_entries_check_everything_before_the_work(files, tmp_path):
    """Each entry refuses a bad spec in its fields' names, before any output is written."""
    from dsparkctl.app.audit import AuditSpec, run_audit
    from dsparkctl.app.calibrate import CalibrateSpec, run_calibrate
    from dsparkctl.app.sweep_scheduler import SweepSpec, run_sweep_scheduler
    from dsparkctl.errors import DsparkError

    trace, sps = (files / "full.jsonl",), files / "sps.json"
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "reliability_pos3.png").write_text("mine")  # a user's file among the PNG names
    cases = [
        (lambda: run_calibrate(CalibrateSpec(trace, out=tmp_path)), f"out {tmp_path} is a folder"),
        (lambda: run_calibrate(CalibrateSpec(trace, out=tmp_path / "c.json", bins=1)), "bins must be ≥ 2"),
        (lambda: run_calibrate(CalibrateSpec(trace, out=tmp_path / "c.json", plot_dir=tmp_path / "plots")),
         "refusing to replace it (fix: choose another plot_dir"),
        (lambda: run_sweep_scheduler(SweepSpec(trace, sps, rounds=100, max_new_tokens=1, out=tmp_path / "s.json")),
         "max_new_tokens must be in [2, rounds + 1 = 101]"),
        (lambda: run_sweep_scheduler(SweepSpec(trace, sps, out=tmp_path)), f"out {tmp_path} is a folder"),
        (lambda: run_sweep_scheduler(SweepSpec(trace, sps, concurrency=(64,), rounds=10)),
         "concurrency 64 is more than rounds 10"),
        (lambda: run_audit(AuditSpec(plain_rounds=10)), "plain_rounds 10 is too few"),
        (lambda: run_audit(AuditSpec(alpha=0.0)), "alpha 0.0 must be in (0, 1)"),
        (lambda: run_audit(AuditSpec(random_settings=-1)), "random_settings -1 is negative"),
    ]
    for call, words in cases:
        with pytest.raises(DsparkError) as e:
            call()
        assert words in e.value.one_line() and "--" not in e.value.one_line(), e.value.one_line()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["plots", "reliability_pos3.png"]


def test_entries_return_what_the_commands_print(files, tmp_path):
    from dsparkctl.app.calibrate import CalibrateSpec, run_calibrate
    from dsparkctl.app.sweep_scheduler import SweepSpec, run_sweep_scheduler

    said: list[str] = []
    doc = run_calibrate(CalibrateSpec((files / "full.jsonl",), bins=10, out=tmp_path / "c.json"), log=said.append)
    assert json.loads((tmp_path / "c.json").read_text())["temperatures"] == doc["temperatures"]
    assert doc["outputs"]["sglang_sts"] == str(tmp_path / "c.sglang-sts.json") and len(doc["outputs"]["reliability_pngs"]) == 5
    sweep = run_sweep_scheduler(SweepSpec((files / "full.jsonl",), files / "sps.json", policies=("static:1",),
                                          concurrency=(1, 2), rounds=100, out=tmp_path / "s.json"), log=said.append)
    assert json.loads((tmp_path / "s.json").read_text())["rows"] == sweep["rows"]
    assert said == [f"wrote {tmp_path / 'c.json'}, {tmp_path / 'c.sglang-sts.json'}, 5 reliability PNGs in "
                    f"{tmp_path / 'c_reliability'}", f"wrote {tmp_path / 's.json'}"]


def test_sweep_writes_its_figure_and_json_together_or_neither(files, tmp_path, monkeypatch):
    """The figure is staged beside the JSON: when the JSON cannot be written (a full disk, say), no
    figure is left behind either; when it can, both appear."""
    import dsparkctl.app.sweep_scheduler as command
    from dsparkctl.app.sweep_scheduler import SweepSpec, run_sweep_scheduler

    spec = SweepSpec((files / "full.jsonl",), files / "sps.json", policies=("static:1",), concurrency=(1, 2),
                     rounds=100, plot=tmp_path / "f.png", out=tmp_path / "s.json")
    real = command.write_json

    def full_disk(path, obj, each_rank=False):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(command, "write_json", full_disk)
    with pytest.raises(OSError):
        run_sweep_scheduler(spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(command, "write_json", real)
    run_sweep_scheduler(spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.png", "s.json"]
