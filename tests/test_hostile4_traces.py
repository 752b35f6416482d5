"""Hostile inputs, round 4 (issue 28): traces at scale, pooled from other drafts, or counted twice.

Three tables, one per class of what went wrong:
  IDENTITY   traces of another draft or target pooled (and the calibration then taken for both);
  REPEATS    the same rounds twice: a copy, a link, an edited or renumbered copy, a subset, a shard
             copy; and two runs of one dataset split so that a prompt sits on both sides;
  SCALE      how much memory a round costs each reader, the progress each long command reports,
             and the numbers: the streamed readers give exactly what the object reader gave.
Every case drives the command (in-process) or the library entry the command calls.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.errors import DsparkError
from dsparkctl.formats.trace import read_trace, write_synthetic_trace
from dsparkctl.math.synthetic import SyntheticModel
from dsparkctl.strict_json import loads

runner = CliRunner()
SPS = {"format": "dsparkctl-sps/1", "batch_tokens": [1, 4, 16, 64, 256, 1024, 8192],
       "steps_per_sec": [50.0, 40.0, 35.0, 25.0, 12.0, 4.0, 0.6]}
ID_A = {"target": "T", "draft": "drafts/a", "draft_fingerprint": "fpA", "dataset": "mt-bench"}


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


def _rewrite(src: Path, dst: Path, header: Callable[[dict], dict] = lambda h: h,
             rows: Callable[[list[dict]], list[dict]] = lambda r: r, **dump: Any) -> None:
    lines = src.read_text().splitlines()
    body = [json.dumps(r, **dump) for r in rows([json.loads(x) for x in lines[1:]])]
    dst.write_text("\n".join([json.dumps(header(json.loads(lines[0])))] + body) + "\n")


def _new_run(h: dict) -> dict:
    return {**h, "run_id": "0123456789abcdef", "created": "2030-01-01T00:00:00+00:00"}


def _shard(path: Path, n: int = 400, gamma: int = 5, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, gamma, generator=g) * 2
    acc = (torch.rand(n, gamma, generator=g) < torch.sigmoid(logits / 2)).long().cumprod(1).sum(1)
    torch.save({"logits": logits.float(), "prefix_mask": (torch.arange(gamma)[None] < acc[:, None]).float()}, path)


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("traces")
    syn = (lambda name, seed, **h: write_synthetic_trace(d / name, SyntheticModel(), 40, 10, seed=seed,
                                                          extra_header=h))
    syn("a.jsonl", 1, **ID_A)
    syn("other_fp.jsonl", 2, **{**ID_A, "draft": "drafts/b", "draft_fingerprint": "fpB"})
    syn("moved.jsonl", 3, **{**ID_A, "draft": "/elsewhere/a"})  # the same draft at another path
    syn("other_target.jsonl", 4, **{**ID_A, "target": "T2"})
    syn("nofp_a.jsonl", 5, target="T", draft="drafts/a")
    syn("nofp_b.jsonl", 6, target="T", draft="drafts/b")
    syn("rerun.jsonl", 7, **ID_A)  # a second run of the same prompts
    syn("humaneval.jsonl", 8, **{**ID_A, "dataset": "humaneval"})
    syn("other_fp_int.jsonl", 10, **{**ID_A, "draft_fingerprint": 12345})
    write_synthetic_trace(d / "noconf.jsonl", SyntheticModel(), 20, 10, seed=9, with_confidence=False)
    a = d / "a.jsonl"
    shutil.copy(a, d / "copy.jsonl")
    os.link(a, d / "hardlink.jsonl")
    os.symlink(a, d / "symlink.jsonl")
    _rewrite(a, d / "edited_header.jsonl", _new_run)
    _rewrite(a, d / "no_run_id.jsonl", lambda h: {k: v for k, v in h.items() if k != "run_id"})
    _rewrite(a, d / "reformatted.jsonl", _new_run, separators=(",", ":"), sort_keys=True)
    _rewrite(a, d / "renumbered.jsonl", _new_run, lambda rs: [{**r, "request": r["request"] + 1000} for r in rs])
    _rewrite(a, d / "subset.jsonl", _new_run, lambda rs: rs[: len(rs) // 2])
    _rewrite(a, d / "one_request.jsonl", _new_run, lambda rs: [r for r in rs if r["request"] == 7])
    _rewrite(a, d / "reversed.jsonl", _new_run, lambda rs: rs[::-1])
    _rewrite(a, d / "retimed.jsonl", _new_run, lambda rs: [{**r, "draft_ms": 2.5, "verify_ms": 7.25} for r in rs])
    shutil.copy(d / "noconf.jsonl", d / "noconf_copy.jsonl")
    _rewrite(d / "noconf.jsonl", d / "noconf_edited.jsonl", _new_run)
    _shard(d / "s.0.pt")
    shutil.copy(d / "s.0.pt", d / "s_copy.1.pt")
    (d / "sps.json").write_text(json.dumps(SPS))
    for name, fps in (("calib_pooled.json", ["fpA", "fpB"]), ("calib_b.json", ["fpB"]), ("calib_a.json", ["fpA"])):
        (d / name).write_text(json.dumps({"temperatures": [1.0] * 5, "draft_fingerprints": fps}))
    (d / "draft_folder").mkdir()
    shutil.copy(d / "calib_pooled.json", d / "draft_folder" / "calibration.json")
    return d


def _cal(*traces: str) -> list[str]:
    return ["calibrate", *[f"{{d}}/{t}" for t in traces], "--out", "{o}/c.json", "--json", "--bins", "10"]


def _sweep(*traces: str, extra: tuple[str, ...] = ()) -> list[str]:
    return ["sweep-scheduler", *[a for t in traces for a in ("--trace", f"{{d}}/{t}")], "--sps-table", "{d}/sps.json",
            "--rounds", "500", "--policies", "static:1,static:5", "--concurrency", "1,4", "--json", *extra]


def _run(argv: list[str], d: Path, o: Path):
    return runner.invoke(app, [a.replace("{d}", str(d)).replace("{o}", str(o)) for a in argv])


OK = None  # expected: a message fragment (exit 2, one line), or success

# (name, argv, expected message fragment, or None for success)
IDENTITY = [
    ("calibrate: two drafts' fingerprints", _cal("a.jsonl", "other_fp.jsonl"), "draft_fingerprint 'fpB' vs 'fpA'"),
    ("sweep: two drafts' fingerprints", _sweep("a.jsonl", "other_fp.jsonl"), "draft_fingerprint 'fpB' vs 'fpA'"),
    ("calibrate: two targets", _cal("a.jsonl", "other_target.jsonl"), "target 'T2' vs 'T'"),
    ("sweep: two targets", _sweep("a.jsonl", "other_target.jsonl"), "target 'T2' vs 'T'"),
    ("calibrate: two draft names, no fingerprints", _cal("nofp_a.jsonl", "nofp_b.jsonl"),
     "draft 'drafts/b' vs 'drafts/a'"),
    ("sweep: two draft names, no fingerprints", _sweep("nofp_a.jsonl", "nofp_b.jsonl"), "draft 'drafts/b' vs"),
    ("calibrate: an older trace of another draft name", _cal("a.jsonl", "nofp_b.jsonl"), "draft 'drafts/b'"),
    ("calibrate: the third of three differs", _cal("a.jsonl", "humaneval.jsonl", "other_fp.jsonl"),
     "other_fp.jsonl and "),
    ("calibrate: a fingerprint of another type", _cal("a.jsonl", "other_fp_int.jsonl"), "draft_fingerprint 12345"),
    ("sweep: another draft's calibration", _sweep("a.jsonl", extra=("--calibration", "{d}/calib_b.json")),
     "fitted on traces of another draft"),
    ("sweep: a calibration of two drafts pooled", _sweep("a.jsonl", extra=("--calibration", "{d}/calib_pooled.json")),
     "pooled traces of 2 drafts"),
    ("calibrate: one draft at two paths (same fingerprint)", _cal("a.jsonl", "moved.jsonl"), OK),
    ("calibrate: an older trace without a fingerprint, same name", _cal("a.jsonl", "nofp_a.jsonl"), OK),
    ("calibrate: an older trace without a run id", _cal("no_run_id.jsonl"), OK),
    ("sweep: this draft's calibration", _sweep("a.jsonl", extra=("--calibration", "{d}/calib_a.json")), OK),
]

REPEATS = [
    ("calibrate: a byte-identical copy", _cal("a.jsonl", "copy.jsonl"), "same run"),
    ("sweep: a byte-identical copy", _sweep("a.jsonl", "copy.jsonl"), "same run"),
    ("calibrate: the same file twice", _cal("a.jsonl", "a.jsonl"), "given twice"),
    ("sweep: the same file twice", _sweep("a.jsonl", "a.jsonl"), "given twice"),
    ("calibrate: a hard link", _cal("a.jsonl", "hardlink.jsonl"), "given twice"),
    ("sweep: a hard link", _sweep("a.jsonl", "hardlink.jsonl"), "given twice"),
    ("calibrate: a symbolic link", _cal("a.jsonl", "symlink.jsonl"), "given twice"),
    ("sweep: a symbolic link", _sweep("symlink.jsonl", "a.jsonl"), "given twice"),
    ("calibrate: a copy with another run id and time", _cal("a.jsonl", "edited_header.jsonl"), "same rounds"),
    ("sweep: a copy with another run id and time", _sweep("a.jsonl", "edited_header.jsonl"), "same rounds"),
    ("calibrate: a copy without its run id", _cal("no_run_id.jsonl", "a.jsonl"), "same rounds"),
    ("calibrate: a copy written with other JSON spacing", _cal("a.jsonl", "reformatted.jsonl"), "same rounds"),
    ("calibrate: a copy with renumbered requests", _cal("a.jsonl", "renumbered.jsonl"), "same rounds"),
    ("sweep: a copy with renumbered requests", _sweep("a.jsonl", "renumbered.jsonl"), "same rounds"),
    ("calibrate: half of the trace copied", _cal("a.jsonl", "subset.jsonl"), "repeats request 0 of"),
    ("sweep: half of the trace copied", _sweep("subset.jsonl", "a.jsonl"), "repeats request 0 of"),
    ("calibrate: one request copied", _cal("a.jsonl", "humaneval.jsonl", "one_request.jsonl"),
     "one_request.jsonl: request 7 repeats request 7 of"),
    ("calibrate: the rounds in reverse order", _cal("a.jsonl", "reversed.jsonl"), "same rounds"),
    ("calibrate: a copy with other timings", _cal("a.jsonl", "retimed.jsonl"), "same rounds"),
    ("sweep: a copy of a trace without confidences", _sweep("noconf.jsonl", "noconf_copy.jsonl"), "same run"),
    ("sweep: an edited copy without confidences", _sweep("noconf.jsonl", "noconf_edited.jsonl"), "same rounds"),
    ("calibrate: a copy of an SGLang shard", ["calibrate", "{d}/s.0.pt", "{d}/s_copy.1.pt", "--out", "{o}/c.json",
                                              "--bins", "10"], "same rows"),
    ("calibrate: two runs of one dataset", _cal("a.jsonl", "rerun.jsonl"), OK),
    ("calibrate: two datasets", _cal("a.jsonl", "humaneval.jsonl"), OK),
    ("sweep: two runs of one draft", _sweep("a.jsonl", "rerun.jsonl"), OK),
]


@pytest.mark.parametrize("name,argv,expected", IDENTITY + REPEATS, ids=[c[0] for c in IDENTITY + REPEATS])
def test_pooling(name, argv, expected, d, tmp_path):
    r = _run(argv, d, tmp_path)
    if expected is None:
        assert r.exit_code == 0, r.output
        return
    assert r.exit_code == 2, r.output
    assert expected in r.stderr and r.stderr.count("\n") == 1 and "(fix: " in r.stderr, r.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_two_runs_of_one_dataset_split_by_request(d, tmp_path):
    """Request r of both runs is one prompt: both land on the same side (old: 80 requests, each run's apart)."""
    from dsparkctl.tuning.calibration import load_inputs

    _, keys, _ = load_inputs([d / "a.jsonl", d / "rerun.jsonl"], 10)
    assert set(keys[:400].tolist()) == set(keys[400:].tolist())
    doc = loads(_run(_cal("a.jsonl", "rerun.jsonl"), d, tmp_path).stdout)
    assert doc["rounds"]["requests_train"] + doc["rounds"]["requests_heldout"] == 40
    doc = loads(_run(_cal("a.jsonl", "humaneval.jsonl"), d, tmp_path / "x").stdout)
    assert doc["rounds"]["requests_train"] + doc["rounds"]["requests_heldout"] == 80


@pytest.mark.parametrize("case", ["pooled", "another draft's", "this draft's"])
def test_generate_refuses_a_pooled_calibration(case, d):
    """What `generate --calibration` and a draft folder's own calibration.json go through."""
    from dsparkctl.formats.calibration import calibration_draft_notes, own_calibration

    name = {"pooled": "calib_pooled.json", "another draft's": "calib_b.json", "this draft's": "calib_a.json"}[case]
    if case == "this draft's":
        assert calibration_draft_notes(d / name, "fpA") == []
        return
    with pytest.raises(DsparkError):
        calibration_draft_notes(d / name, "fpA")
    if case == "pooled":
        assert own_calibration(d / "draft_folder", "fpA") is None


def test_new_traces_carry_a_run_id(d, tmp_path):
    from dsparkctl.formats.trace import TraceRound, TraceWriter

    ids = {read_trace(d / n).header.get("run_id") for n in ("a.jsonl", "other_fp.jsonl", "noconf.jsonl")}
    with TraceWriter(tmp_path / "t.jsonl", {"draft": "x"}) as w:
        w.write([TraceRound(0, 0, 2, None, 2, 1, 6, 1.0, 1.0)])
    ids.add(read_trace(tmp_path / "t.jsonl").header.get("run_id"))
    assert None not in ids and len(ids) == 4 and all(isinstance(i, str) and len(i) >= 16 for i in ids)


# ------------------------------------------------------------------------------------------ scale
def _peak_bytes(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """20,000 rounds (~4.7 MB): objects would take ~40 MB, columns ~2 MB."""
    p = tmp_path_factory.mktemp("big") / "big.jsonl"
    write_synthetic_trace(p, SyntheticModel(), 400, 50, seed=3, extra_header=ID_A)
    return p


READERS = {
    "calibrate": lambda p: __import__("dsparkctl.tuning.calibration", fromlist=["x"]).load_inputs([p], 20),
    "sweep-scheduler": lambda p: __import__("dsparkctl.tuning.sweep", fromlist=["x"]).load_replay_rounds([p]),
    "served --offline": lambda p: __import__("dsparkctl.serving.parity", fromlist=["x"]).read_offline(p),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_a_round_costs_tens_of_bytes(reader, big):
    READERS[reader](big)  # imports and first-call allocations out of the count
    per_round = _peak_bytes(lambda: READERS[reader](big)) / 20_000
    assert per_round < 300, f"{reader}: {per_round:.0f} bytes a round"


def test_the_synthetic_writer_streams(tmp_path):
    """`write_synthetic_trace` (benchmarks, docs) writes Python objects one chunk at a time."""
    write_synthetic_trace(tmp_path / "w0.jsonl", SyntheticModel(), 10, 10)
    per_round = _peak_bytes(lambda: write_synthetic_trace(tmp_path / "w.jsonl", SyntheticModel(), 800, 50)) / 40_000
    assert per_round < 150, f"{per_round:.0f} bytes a round"


class _Bar:
    """Stands in for `console.progress_bar`: records every update."""

    def __init__(self):
        self.updates: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def __call__(self, label, total, **kw):
        yield lambda completed=None, advance=0, description=None, total=None: self.updates.append((completed, total))


@pytest.mark.parametrize("command", ["calibrate", "sweep-scheduler", "audit", "served --offline"])
def test_long_commands_show_progress(command, big, tmp_path, monkeypatch):
    bar = _Bar()
    module = "dsparkctl.cli.serve" if command.startswith("served") else "dsparkctl.cli.schedule"
    monkeypatch.setattr(f"{module}.progress_bar", bar, raising=False)
    size = big.stat().st_size
    if command == "calibrate":
        argv = ["calibrate", str(big), "--out", str(tmp_path / "c.json"), "--json"]
    elif command == "sweep-scheduler":
        (tmp_path / "sps.json").write_text(json.dumps(SPS))
        argv = ["sweep-scheduler", "--trace", str(big), "--sps-table", str(tmp_path / "sps.json"), "--rounds", "200",
                "--policies", "static:5", "--concurrency", "1", "--json"]
    elif command == "audit":
        argv = ["audit", "--policies", "static:1", "--rounds", "1000", "--plain-rounds", "1000",
                "--random-settings", "0", "--json"]
        size = 2  # runs: Appendix A with and without a plain-step price
    else:
        from tests.test_served import VllmServer, rounds

        scrape = VllmServer().feed(rounds(500)).scrape(tmp_path / "m.txt")
        argv = ["served", str(scrape), "--offline", str(big), "--json"]
    r = runner.invoke(app, argv)
    assert r.exit_code in (0, 1), r.output
    assert bar.updates and bar.updates[-1] == (size, size), bar.updates[-3:]


def test_no_progress_off_a_terminal(big, tmp_path):
    """Off a terminal nothing but the document: stdout parses, stderr holds only the 'wrote' line."""
    r = runner.invoke(app, ["calibrate", str(big), "--out", str(tmp_path / "c.json"), "--json"])
    assert r.exit_code == 0 and loads(r.stdout)["block_size"] == 5
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("wrote ")


def test_offline_trace_of_two_block_sizes(d, tmp_path):
    """served --offline with a trace mixing block sizes: one line, not a ValueError."""
    from dsparkctl.serving.parity import read_offline

    _rewrite(d / "a.jsonl", tmp_path / "mixed.jsonl",
             rows=lambda rs: [{**r, "block_size": 8, "verify_length": 8, "confidence_logits": None}
                              if r["request"] == 39 else r for r in rs])
    with pytest.raises(DsparkError, match="block size 8 differs from 5"):
        read_offline(tmp_path / "mixed.jsonl")


# --------------------------------------------- the numbers: streamed columns == the object reader
def _oracle_table(paths: list[Path]) -> dict[str, Any]:
    """The rows as the object reader (`read_trace`, ~2 KB a round) gives them, keyed per (file, request)."""
    logits, ell, acc, keys, capped, ids = [], [], [], [], [], {}
    for ti, p in enumerate(paths):
        for r in read_trace(p).rounds:
            if r.drafted:
                logits.append(r.confidence_logits or [float("nan")] * r.block_size)
                ell.append(r.verify_length)
                acc.append(r.accepted)
                keys.append(ids.setdefault((ti, r.request), len(ids)))
                capped.append(r.budget_capped)
    return {"logits": torch.tensor(logits, dtype=torch.float64), "verify_length": torch.tensor(ell),
            "accepted": torch.tensor(acc), "keys": torch.tensor(keys), "capped": torch.tensor(capped)}


class _Header(dict):
    """A trace header that also reads as the Trace object the first reader passed (`.header`)."""

    @property
    def header(self) -> dict:
        return self


def _with_plain_steps(src: Path, dst: Path) -> Path:
    """Every 7th round a plain step, every 11th budget-capped (what generate records)."""
    _rewrite(src, dst, _new_run, lambda rs: [
        {**r, "drafted": False, "verify_length": 0, "accepted": 0, "confidence_logits": None} if i % 7 == 3 else
        {**r, "budget_capped": True, "verify_length": 2, "accepted": min(r["accepted"], 2)} if i % 11 == 5 else r
        for i, r in enumerate(rs)])
    return dst


@pytest.mark.parametrize("files", [["a.jsonl"], ["a.jsonl", "humaneval.jsonl"], ["plain"]])
def test_calibration_numbers_are_the_object_readers(files, d, tmp_path):
    from dsparkctl.math.calibration import CalibrationData
    from dsparkctl.tuning.calibration import calibrate_traces, fit_calibration

    paths = [_with_plain_steps(d / "a.jsonl", tmp_path / "p.jsonl") if f == "plain" else d / f for f in files]
    o = _oracle_table(paths)
    data = CalibrationData(o["logits"], o["verify_length"], o["accepted"])
    old = fit_calibration(paths, (data, o["keys"], [_Header(read_trace(p).header) for p in paths]), 0.2, 20, 0)
    new = calibrate_traces(paths, holdout=0.2, bins=20, seed=0)
    for doc in (old, new):
        doc.pop("provenance")
    assert json.dumps(new, allow_nan=True) == json.dumps(old, allow_nan=True)


@pytest.mark.parametrize("files", [["a.jsonl"], ["a.jsonl", "humaneval.jsonl"], ["plain"], ["noconf.jsonl"]])
def test_sweep_pool_is_the_object_readers(files, d, tmp_path):
    from dsparkctl.tuning.sweep import load_replay_rounds

    paths = [_with_plain_steps(d / "a.jsonl", tmp_path / "p.jsonl") if f == "plain" else d / f for f in files]
    o = _oracle_table(paths)
    pool = load_replay_rounds(paths)
    keep = ~o["capped"]
    assert torch.equal(pool["accepted"], o["accepted"][keep])
    assert torch.equal(pool["logits"].isnan(), o["logits"][keep].isnan())
    assert torch.equal(pool["logits"].nan_to_num(), o["logits"][keep].nan_to_num())
    assert pool["skipped"] == int(o["capped"].sum()) + sum(not r.drafted for p in paths for r in read_trace(p).rounds)


def test_parity_numbers_are_the_object_readers(d, tmp_path):
    from dsparkctl.math.stats import AcceptanceStats
    from dsparkctl.serving.parity import read_offline

    p = _with_plain_steps(d / "a.jsonl", tmp_path / "p.jsonl")
    drafted = [r for r in read_trace(p).rounds if r.drafted]
    s = AcceptanceStats(block_size=5)
    s.add_rounds([r.verify_length for r in drafted], [r.accepted for r in drafted])
    got = read_offline(p)
    assert (got["tau"], got["conditional"], got["rounds"]) == (s.tau, s.conditional(), s.rounds)
