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
