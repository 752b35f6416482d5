"""Hostile round 5, the commands: contradictory or misspelled options refused in one line before
any model loads (each took 7-15 s, or was silently dropped), and a figure suffix that cannot be
written named without matplotlib's own chatter."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


@pytest.mark.parametrize("args,expect", [
    (["generate", "hi", "--stream", "--json"], "--stream prints the text as it comes"),
    (["generate", "hi", "--policy", "static:0", "--siblings", "3"], "static:0 never drafts"),
    (["generate", "hi", "--policy", "bogus"], "unknown policy"),
    (["generate", "hi", "--policy", "threshold:2"], "argument must be in"),
    (["generate", "hi", "--calibration", "/nonexistent/c.json"], "calibration file /nonexistent/c.json does not exist"),
    (["generate", "hi", "--sps-table", "/nonexistent/s.json"], "SPS table /nonexistent/s.json does not exist"),
    (["generate", "hi", "--draft", "/nonexistent/draft"], "model path /nonexistent/draft does not exist"),
    (["eval-acceptance", "--mode", "teacher-forced", "--trace", "t.jsonl"], "teacher-forced runs none"),
    (["eval-acceptance", "--draft", "random", "--draft", "random"], "both be reported as 'random'"),
    (["eval-acceptance", "--draft", "random", "--draft", "default", "--label", "a", "--label", "a"],
     "both be reported as 'a'"),
    (["eval-acceptance", "--plot", "p.txt"], "cannot write figures of type '.txt'"),
    (["convert", "default", "new", "--to", "speculators", "--drop", "bogus"], "not something a conversion can drop"),
])
def test_refused_in_one_line_before_any_model_loads(tmp_path, monkeypatch, args, expect):
    monkeypatch.chdir(tmp_path)
    t = time.monotonic()
    r = runner.invoke(app, args)
    took = time.monotonic() - t
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], r.stderr
    assert not r.stdout and list(tmp_path.iterdir()) == []  # nothing printed to stdout, nothing written
    assert took < 5, f"{args}: {took:.1f} s: checked after something slow"


@pytest.mark.parametrize("args,expect", [
    (["generate", "hi", "--draft", "x/[b]"], "is not a valid hub repo id"),
    (["generate", "hi", "--stream", "--batch-size", "4"], "one request at a time; --batch-size 4"),
    (["generate", "hi", "--stream", "--no-text"], "--no-text contradicts it"),
    (["generate", "hi", "--policy", "static:0", "--lookup"], "static:0 verifies none"),
    (["profile-sps", "--measure", "target-forward", "--draft", "/nonexistent/d", "--out", "s.json"],
     "--draft would not be used"),
    (["generate", "--dataset", "mt-bench", "--field", "q"], "the built-in set mt-bench has its own"),
])
def test_pass_two_refused_in_one_line_before_any_model_loads(tmp_path, monkeypatch, args, expect):
    test_refused_in_one_line_before_any_model_loads(tmp_path, monkeypatch, args, expect)


def test_pass_two_files_of_another_kind_and_repeated_cells(tmp_path, monkeypatch):
    """An SPS table given as a trace is named as such (not "not valid JSON"); an unparsable
    calibration is refused before loading; a sweep refuses a policy past the block size and a
    repeated policy or load level; a .txt prompt file refuses --field."""
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sps.json").write_text(json.dumps({"format": "dsparkctl-sps/2", "rows": [1, 2]}, indent=1))
    r = runner.invoke(app, ["calibrate", "sps.json", "--out", "c.json"])
    assert r.exit_code != 0 and "sps.json is a 'dsparkctl-sps/2' document, not a trace" in r.stderr, r.output
    (tmp_path / "broken.json").write_text("{broken")
    r = runner.invoke(app, ["generate", "hi", "--calibration", "broken.json"])
    assert r.exit_code != 0 and "broken.json: not valid JSON" in r.stderr
    (tmp_path / "p.txt").write_text("one\ntwo\n")
    r = runner.invoke(app, ["generate", "--prompts-file", "p.txt", "--field", "q"])
    assert r.exit_code == 2 and "holds one prompt per line" in r.stderr
    for extra, expect in ((["--policies", "static:5,static:5"], "names static:5 twice"),
                          (["--policies", "static:1", "--concurrency", "1,1"], "names 1 twice")):
        r = runner.invoke(app, ["sweep-scheduler", "--trace", "sps.json", "--sps-table", "sps.json", *extra])
        assert r.exit_code == 2 and expect in r.stderr, r.output
