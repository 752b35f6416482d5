"""Shared CLI plumbing (cli/options.py, console.py, guard.py). Numbers in option lists are bounded where they are parsed
(issue 20, class 4): a typo such as --requests 1,99999999999 is one usage line, exit 2, before any
model loads; typer's own usage errors are one line too."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.cli.options import INT_LIST_MAX, int_list
from dsparkctl.engine.profile import check_batch_tokens
from dsparkctl.errors import UsageError


@pytest.mark.parametrize("text,result", [
    ("1,2,4", [1, 2, 4]), (f"1,{INT_LIST_MAX}", [1, INT_LIST_MAX]),
    ("1,99999999999", "--requests 99999999999 is larger than 65536"), ("0,1", "must be positive"),
    ("1,x", "comma-separated integers"), ("", "must be positive"), ("-3", "must be positive"),
])
def test_int_list(text, result):
    if isinstance(result, list):
        assert int_list(text, "--requests") == result
    else:
        with pytest.raises(UsageError, match=result):
            int_list(text, "--requests")


def test_check_batch_tokens():
    check_batch_tokens([1, 64], [1, 6], 256)
    with pytest.raises(UsageError, match="token positions in one batch"):
        check_batch_tokens([1, 65536], [1, 6], 256)


@pytest.mark.parametrize("argv,message", [
    (["profile-sps", "--requests", "1,99999999999"], "error: --requests 99999999999 is larger than 65536"),
    (["sweep-scheduler", "--trace", "t", "--sps-table", "s", "--concurrency", "1,1e12"], "comma-separated integers"),
    (["sweep-scheduler", "--trace", "t", "--sps-table", "s", "--concurrency", "1,99999999999"],
     "error: --concurrency 99999999999 is larger than 65536")])
def test_through_the_cli(tmp_path, monkeypatch, argv, message):
    monkeypatch.setattr(console.err, "soft_wrap", True)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2 and r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1, r.output
    assert message in r.output
    assert list(tmp_path.iterdir()) == []


# -------- typer's own usage errors, one line each
runner = CliRunner()


@pytest.mark.parametrize("argv,needle", [
    (["train", "--max-minutes", "nan"], "Invalid value for '--max-minutes'"),
    (["profile-sps", "--measure", "bogus"], "Invalid value for '--measure'"),
    (["train", "--no-such-option"], "No such option: --no-such-option"),
    (["no-such-command"], "No such command"),
    (["generate", "--dtype"], "requires an argument. (see 'dsparkctl generate --help')"),
])
def test_command_line_mistakes_are_one_line(argv, needle):
    """Through the real entry point: typer's boxed usage errors become one line, exit 2."""
    res = subprocess.run([sys.executable, "-m", "dsparkctl", *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr
    assert "╭" not in res.stderr and res.stdout == ""


@pytest.mark.parametrize("revision", ["../x", "a b", "", "main/", "x..y", "-rf", "a\nb", "a/.b", "mäin"])
def test_bad_revision_is_refused_before_any_lookup(revision, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # were it looked up, the error would be the network
    res = runner.invoke(app, ["inspect", "org/name", "--revision", revision])
    assert res.exit_code == 2 and "Invalid value for '--revision'" in res.output, res.output


def test_messages_name_options_as_the_running_command_does():
    """A library message names an input once (`errors.option`); Python callers read the field, the
    CLI the flag of the command that ran, found from the command's own typer options."""
    from dsparkctl.cli.evaluate import eval_acceptance
    from dsparkctl.cli.guard import option_names
    from dsparkctl.cli.profile import profile_sps_cmd
    from dsparkctl.errors import UsageError, option

    exc = UsageError(f"{option('max_new_tokens')} must be >= 1", f"use {option('tokens_per_request')} 1,2")
    assert str(exc) == exc.message == "max_new_tokens must be >= 1" and exc.hint == "use tokens_per_request 1,2"
    profile = option_names(profile_sps_cmd.__wrapped__)
    assert profile["out_path"] == profile["out"] == "--out"  # the parameter and the flag's own words
    assert profile["tokens_per_request"] == "--tokens-per-request" and profile["json_out"] == "--json"
    assert exc.one_line(profile) == "max_new_tokens must be >= 1 (fix: use --tokens-per-request 1,2)"
    evaluate = option_names(eval_acceptance.__wrapped__, {"drafts": "draft"})
    assert exc.one_line(evaluate).startswith("--max-new-tokens must be >= 1")
    assert evaluate["drafts"] == "--draft" and evaluate["labels"] == "--label"
