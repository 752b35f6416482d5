"""Hostile inputs, round 4 (issue 28), classes 4 and 5: hostile values met late or as internal
errors (deep nesting, numbers of hundreds of digits, NaN, figure formats the writer cannot write, a
terminal that cannot print UTF-8, a folder where a lock goes, a prompt of megabytes), and messages
that named the wrong cause or no fix (`~` in `--opt=~/x`, unreadable weights, lock waits, fit
warnings, the audit table at 80 columns, `--set k=`, option parsers that took "５").

A refused case: exit ≠ 0, exactly one `error:` line with a fix, no internal error, nothing written.
Below the table: what must work instead of failing."""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.formats.trace import write_synthetic_trace
from dsparkctl.math.synthetic import SyntheticModel
from tests.helpers import snapshot, tiny_recipe, write_tiny_prompts
from tests.tiny_models import save_tiny_target, write_deepspec_draft

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
SPS = {"format": "dsparkctl-sps/1", "batch_tokens": [1, 4, 16, 64, 256], "steps_per_sec": [50.0, 40.0, 35.0, 25.0, 12.0],
       "measures": "whole-step"}
BIG = "1" + "0" * 400  # 10**400
HUGE = "1" + "0" * 5000  # more digits than Python converts without a ValueError
LONG_PROMPT = "w3 " * 350_000  # 1,050,000 characters


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


@pytest.fixture(autouse=True)
def _bounded():
    """A case that would run for ever (old code took --rounds 10**30 at its word) fails after 120 s."""
    import signal

    def stop(*_):
        raise TimeoutError("the case ran for more than 120 s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def w(tmp_path_factory) -> Path:
    r = tmp_path_factory.mktemp("hostile4")
    target = save_tiny_target(r / "target", "llama", vocab=64, layers=4)
    write_deepspec_draft(r / "draft", block_size=4)
    prompts = write_tiny_prompts(r / "prompts.txt")
    (r / "recipe.toml").write_text(tiny_recipe(target, prompts))
    base = (r / "recipe.toml").read_text()
    (r / "deep.toml").write_text(base + "x = " + "[" * 50_000 + "]" * 50_000 + "\n")
    (r / "deep2.toml").write_text(base + "y = " + "{a=" * 3000 + "1" + "}" * 3000 + "\n")
    (r / "digits.toml").write_text(base.replace("steps = 2", f"steps = {HUGE}"))
    (r / "big.toml").write_text(base.replace("steps = 2", f"steps = {BIG}"))
    write_synthetic_trace(r / "trace.jsonl", SyntheticModel(), 40, 10, seed=1)
    lines = (r / "trace.jsonl").read_text().splitlines()
    row = json.loads(lines[1])
    (r / "digits-trace.jsonl").write_text("\n".join([lines[0], json.dumps(row).replace(
        f'"request": {row["request"]}', f'"request": {HUGE}'), *lines[2:]]) + "\n")
    (r / "sps.json").write_text(json.dumps(SPS))
    (r / "sps.sglang.json").write_text(json.dumps({"sample_batch_tokens": SPS["batch_tokens"],
                                                   "sample_steps_per_sec": SPS["steps_per_sec"],
                                                   "max_batch_tokens": 256}))
    (r / "digits-sps.json").write_text(json.dumps(SPS).replace('"batch_tokens": [1,', f'"batch_tokens": [{HUGE},'))
    (r / "huge.txt").write_text("w3 w4\n" + LONG_PROMPT + "\n")
    (r / "huge.jsonl").write_text(json.dumps({"prompt": "w3"}) + "\n" + json.dumps({"prompt": LONG_PROMPT}) + "\n")
    (r / "huge.json").write_text(json.dumps([{"prompt": LONG_PROMPT}]))
    (r / "digits.jsonl").write_text('{"prompt": "w3", "n": ' + HUGE + "}\n")
    (r / "long.txt").write_text("w3 " * 2100 + "\n")  # 2,100 tokens: more than the tiny target's 2,048 positions
    (r / "shard.pt").mkdir()
    (r / "huge-recipe.toml").write_text(tiny_recipe(target, r / "huge.txt"))
    return r


T, D = ["--target", "{r}/target"], ["--draft", "{r}/draft"]
GEN = ["generate", *T, *D, "--no-chat", "--max-new-tokens", "4", "--policy", "static:4"]
TRAIN = ["train", "{r}/recipe.toml", "--cache-dir", "{r}/c"]
SWEEP = ["sweep-scheduler", "--sps-table", "{r}/sps.json", "--trace", "{r}/trace.jsonl"]
PROFILE = ["profile-sps", *T, "--out", "{r}/new-sps.json", "--requests", "1", "--tokens-per-request", "1,2"]
EVAL = ["eval-acceptance", *T, *D, "--dataset", "{r}/prompts.txt", "--limit", "1", "--max-new-tokens", "8"]
AUDIT = ["audit", "--rounds", "1000", "--random-settings", "0", "--policies", "static:2"]
EXTRACT = ["extract", "{r}/draft", "{r}/extracted"]

REFUSED = [
    # class 4: deep nesting and numbers of hundreds of digits (TOML, JSON, options)
    ("recipe nested 50,000 lists deep", ["train", "{r}/deep.toml"], "nested too deeply"),
    ("recipe nested 3,000 inline tables deep", ["train", "{r}/deep2.toml"], "nested too deeply"),
    ("recipe int of 5,001 digits", ["train", "{r}/digits.toml"], "not valid TOML"),
    ("recipe steps = 10**400", ["train", "{r}/big.toml"], "optim.steps (a number of 401 digits) is more than"),
    ("--set a value nested 5,000 deep", [*TRAIN, "--set", "optim.loss_weights=" + "[" * 5000 + "]" * 5000],
     "nested too deeply"),
    ("--set an int of 5,001 digits", [*TRAIN, "--set", f"optim.steps={HUGE}"], "too many digits"),
    ("trace with a 5,001-digit request", ["calibrate", "{r}/digits-trace.jsonl", "--out", "{r}/cal.json"],
     "too large a number"),
    ("SPS table with a 5,001-digit size", [*SWEEP[:1], "--sps-table", "{r}/digits-sps.json", "--trace",
                                           "{r}/trace.jsonl"], "too large a number"),
    ("prompt JSONL with a 5,001-digit number", [*GEN, "--dataset", "{r}/digits.jsonl"], "not valid JSON"),
    ("generate --max-new-tokens 10**400", [*GEN[:-4], "--max-new-tokens", BIG, "hi"], "--max-new-tokens"),
    ("generate --batch-size 2**63", [*GEN, "--batch-size", str(2 ** 63), "hi"], "--batch-size"),
    ("generate --seed 10**30", [*GEN, "--seed", str(10 ** 30), "hi"], "--seed"),
    ("generate --temperature 1e400", [*GEN, "--temperature", "1e400", "hi"], "--temperature"),
    ("generate --top-p nan", [*GEN, "--top-p", "nan", "hi"], "--top-p"),
    ("generate --top-k 10**30", [*GEN, "--top-k", str(10 ** 30), "hi"], "--top-k"),
    ("profile-sps --context-len 10**30", [*PROFILE, "--context-len", str(10 ** 30)], "--context-len"),
    ("profile-sps --repeats 10**400", [*PROFILE, "--repeats", BIG], "--repeats"),
    ("sweep-scheduler --rounds 10**30", [*SWEEP, "--rounds", str(10 ** 30)], "--rounds"),
    ("sweep-scheduler --max-new-tokens 2**64", [*SWEEP, "--max-new-tokens", str(2 ** 64)], "--max-new-tokens"),
    ("eval-acceptance --limit 10**400", [*EVAL[:-4], "--limit", BIG], "--limit"),
    ("audit --alpha inf", [*AUDIT, "--alpha", "inf"], "--alpha must be a finite number"),
    ("audit --rounds 10**30", ["audit", "--rounds", str(10 ** 30)], "--rounds"),
    ("calibrate --holdout nan", ["calibrate", "{r}/trace.jsonl", "--holdout", "nan"], "--holdout"),
    ("calibrate --bins 10**400", ["calibrate", "{r}/trace.jsonl", "--bins", BIG], "--bins"),
    ("train --max-minutes 1e400", [*TRAIN, "--max-minutes", "1e400"], "--max-minutes must be a finite number"),
    ("train --max-steps 10**30", [*TRAIN, "--max-steps", str(10 ** 30)], "--max-steps"),
    # class 4: a figure format the up-front check passes must be one the writer can write
    ("eval-acceptance --plot .pgf (needs LaTeX)", [*EVAL, "--plot", "{r}/fig.pgf"], "cannot write figures of type"),
    ("sweep-scheduler --plot .pgf", [*SWEEP, "--plot", "{r}/fig.pgf"], "cannot write figures of type"),
    ("profile-sps --plot .PGF", [*PROFILE, "--plot", "{r}/fig.PGF"], "cannot write figures of type"),
    ("sweep-scheduler --plot .xyz", [*SWEEP, "--plot", "{r}/fig.xyz"], "cannot write figures of type"),
    # class 4: one prompt of megabytes is refused by its size before any tokenizer sees it
    ("generate a 1M-character argument", [*GEN, LONG_PROMPT], "prompts longer than 1,000,000 characters"),
    ("generate --prompts-file with a 1M-character line", [*GEN, "--prompts-file", "{r}/huge.txt"],
     "prompts longer than 1,000,000 characters"),
    ("generate --dataset JSONL with a 1M-character prompt", [*GEN, "--dataset", "{r}/huge.jsonl"],
     "prompts longer than 1,000,000 characters"),
    ("eval-acceptance --dataset JSON with a 1M-character prompt", [*EVAL[:-6], "--dataset", "{r}/huge.json"],
     "prompts longer than 1,000,000 characters"),
    ("train on a dataset with a 1M-character prompt", ["train", "{r}/huge-recipe.toml", "--cache-dir", "{r}/c"],
     "prompts longer than 1,000,000 characters"),
    ("generate a prompt longer than the target's positions", [*GEN, "--prompts-file", "{r}/long.txt"],
     "shorten it to at most"),
    # class 5: --set with an empty or multi-line value; a recipe's range errors name key, value and a fix
    ("--set name= (empty)", [*TRAIN, "--set", "name="], "--set name= has an empty value"),
    ("--set optim.steps= (empty)", [*TRAIN, "--set", "optim.steps="], "--set optim.steps= has an empty value"),
    ("--set a value with a line break", [*TRAIN, "--set", 'optim.steps=2\nname="other"'], "holds a line break"),
    ("--set optim.steps=0", [*TRAIN, "--set", "optim.steps=0"], "optim.steps must be >= 1, got 0"),
    ("--set optim.checkpoint_every=0", [*TRAIN, "--set", "optim.checkpoint_every=0"],
     "optim.checkpoint_every must be >= 1, got 0"),
    ("--set optim.threads=-1", [*TRAIN, "--set", "optim.threads=-1"], "optim.threads must be >= 0, got -1"),
    ("--set data.num_prompts=1", [*TRAIN, "--set", "data.num_prompts=1"], "data.num_prompts must be >= 2, got 1"),
    ("--set eval.temperature=-1", [*TRAIN, "--set", "eval.temperature=-1"], "eval.temperature must be >= 0"),
    ("--set draft.block_size=0", [*TRAIN, "--set", "draft.block_size=0"], "draft.block_size must be >= 1"),
    ("--set draft.num_layers=10**30", [*TRAIN, "--set", f"draft.num_layers={10 ** 30}"], "use at most 256"),
    # class 5: messages that had no fix
    ("sweep-scheduler --rounds 0", [*SWEEP, "--rounds", "0"], "--rounds must be ≥ 1, got 0"),
    ("profile-sps --repeats 0", [*PROFILE, "--repeats", "0"], "--repeats must be >= 1"),
    ("calibrate a .pt that is a folder", ["calibrate", "{r}/shard.pt", "--out", "{r}/cal.json"], "shard.pt"),
    ("eval-acceptance two labels, one draft", [*EVAL, "--label", "a", "--label", "b"], "--label"),
    ("generate --dataset a folder", [*GEN, "--dataset", "{r}/shard.pt"], "is not a file"),
    # class 5: a lock-wait setting that is no number of seconds is refused, not read as 30 min
    ("DSPARKCTL_LOCK_WAIT_S=abc", [*TRAIN, "--set", "optim.steps=1", "--env", "DSPARKCTL_LOCK_WAIT_S=abc"],
     "DSPARKCTL_LOCK_WAIT_S='abc' is not a number of seconds"),
    ("DSPARKCTL_LOCK_WAIT_S=-5", [*TRAIN, "--env", "DSPARKCTL_LOCK_WAIT_S=-5"], "not a number of seconds"),
    ("DSPARKCTL_LOCK_WAIT_S=nan", [*TRAIN, "--env", "DSPARKCTL_LOCK_WAIT_S=nan"], "not a number of seconds"),
    ("DSPARKCTL_LOCK_WAIT_S=５", [*TRAIN, "--env", "DSPARKCTL_LOCK_WAIT_S=５"], "not a number of seconds"),
    ("DSPARKCTL_LOCK_WAIT_S=1e400", [*TRAIN, "--env", "DSPARKCTL_LOCK_WAIT_S=1e400"], "not a number of seconds"),
    ("DSPARKCTL_LOCK_WAIT_S=10min", [*TRAIN, "--env", "DSPARKCTL_LOCK_WAIT_S=10min"], "not a number of seconds"),
    # class 5: option parsers take ASCII digits only; shard sizes below a sane minimum are refused
    ("generate --policy static:５", [*GEN[:-2], "--policy", "static:５", "hi"], "is not a valid int"),
    ("generate --policy static:1_0", [*GEN[:-2], "--policy", "static:1_0", "hi"], "is not a valid int"),
    ("generate --policy 'static: 3'", [*GEN[:-2], "--policy", "static: 3", "hi"], "is not a valid int"),
    ("generate --policy threshold:０.５", [*GEN[:-2], "--policy", "threshold:０.５", "hi"], "is not a valid float"),
    ("generate --policy threshold:0_5", [*GEN[:-2], "--policy", "threshold:0_5", "hi"], "is not a valid float"),
    ("sweep-scheduler --policies static:٣", [*SWEEP, "--policies", "static:٣"], "is not a valid int"),
    ("profile-sps --requests ５", [*PROFILE[:-4], "--requests", "５", "--tokens-per-request", "1,2"], "--requests"),
    ("profile-sps --requests 1_0", [*PROFILE[:-4], "--requests", "1_0", "--tokens-per-request", "1,2"], "--requests"),
    ("profile-sps --tokens-per-request '2\\n'", [*PROFILE[:-2], "--tokens-per-request", "2\n"], "--tokens-per-request"),
    ("sweep-scheduler --concurrency ８", [*SWEEP, "--concurrency", "８"], "--concurrency"),
    ("extract --max-shard-size 1", [*EXTRACT, "--max-shard-size", "1"], "below the minimum"),
    ("extract --max-shard-size 1KB", [*EXTRACT, "--max-shard-size", "1KB"], "below the minimum"),
    ("extract --max-shard-size ５GB", [*EXTRACT, "--max-shard-size", "５GB"], "is not a size"),
    ("extract --max-shard-size 99999999999999TB", [*EXTRACT, "--max-shard-size", "99999999999999TB"],
     "more than a petabyte"),
    ("extract --max-shard-size '5GB\\n'", [*EXTRACT, "--max-shard-size", "5GB\n"], "is not a size"),
]


def _argv(argv: list[str], r: Path) -> tuple[list[str], dict[str, str]]:
    env, out, it = {}, [], iter(argv)
    for a in it:
        if a == "--env":
            k, _, v = next(it).partition("=")
            env[k] = v
        else:
            out.append(a.replace("{r}", str(r)))
    return out, env


@pytest.mark.parametrize("case,argv,needle", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_in_one_line_with_a_fix(case, argv, needle, w, monkeypatch):
    args, env = _argv(argv, w)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(w)
    before = snapshot(w)
    res = runner.invoke(app, args)
    errors = [m for m in res.stderr.splitlines() if m.startswith(("error:", "internal error:"))]
    assert res.exit_code not in (0, None), f"{case}: exit 0\n{res.output[-500:]}"
    assert len(errors) == 1 and errors[0].startswith("error:"), f"{case}: {res.stderr[-600:]!r}"
    assert "(fix: " in errors[0], f"{case}: no fix in {errors[0]!r}"
    assert needle in errors[0], f"{case}: {needle!r} not in {errors[0]!r}"
    assert snapshot(w) == before, f"{case}: files left or changed"


def test_the_count_rule_says_its_fix():
    from dsparkctl.checks import check_positive
    from dsparkctl.errors import UsageError

    with pytest.raises(UsageError) as e:
        check_positive(0, "limit")
    assert e.value.one_line({"limit": "--limit"}) == "--limit must be >= 1, got 0 (fix: give --limit 1 or more)"


def test_every_raised_error_carries_a_fix():
    """Every InputError/UsageError/CheckpointError/ModelMismatchError raised in the library has a hint."""
    missing = []
    for f in sorted((ROOT / "dsparkctl").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and getattr(node.exc.func, "id", None) in ("InputError", "UsageError", "CheckpointError",
                                                                "ModelMismatchError")
                    and len(node.exc.args) < 2 and not any(k.arg == "hint" for k in node.exc.keywords)):
                missing.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not missing, missing


# ------------------------------------------------------------------ what must work instead of failing
FIGURES = [".PNG", ".svgz", ".eps", ".ps", ".jpg", ".tif", ".pdf", ""]


@pytest.mark.parametrize("suffix", FIGURES)
def test_figure_formats_the_check_passes_are_written(suffix, w, tmp_path):
    fig = tmp_path / f"frontier{suffix}"
    res = runner.invoke(app, [*(a.replace("{r}", str(w)) for a in SWEEP), "--rounds", "50", "--policies", "static:2",
                              "--concurrency", "1", "--plot", str(fig), "--out", str(tmp_path / "s.json")])
    assert res.exit_code == 0, res.output[-500:]
    assert fig.is_file() and fig.stat().st_size > 0


TILDE = [  # the shell leaves "~" in --opt=~/x: we expand it (HOME is the test's folder)
    ("calibrate --out=~/c.json", ["calibrate", "{r}/trace.jsonl", "--out=~/c.json"], "c.json"),
    ("sweep-scheduler --sps-table=~/sps.json --out=~/s.json", ["sweep-scheduler", "--sps-table=~/sps.json",
                                                               "--trace=~/trace.jsonl", "--rounds", "50",
                                                               "--concurrency", "1", "--out=~/s.json"], "s.json"),
    ("generate --target=~/target --draft=~/draft --trace=~/t.jsonl", ["generate", "--target=~/target", "--draft=~/draft",
                                                                      "--no-chat", "--max-new-tokens", "4",
                                                                      "--policy", "static:4", "--trace=~/t.jsonl",
                                                                      "hi"], "t.jsonl"),
    ("generate --prompts-file=~/prompts.txt", [*GEN, "--prompts-file=~/prompts.txt", "--limit", "1"], None),
    ("eval-acceptance --dataset=~/prompts.txt --out=~/e.json", [*EVAL[:3], "--draft=~/draft", "--dataset=~/prompts.txt",
                                                                 "--limit", "1", "--max-new-tokens", "8",
                                                                 "--out=~/e.json"], "e.json"),
]


@pytest.mark.parametrize("case,argv,written", TILDE, ids=[c[0] for c in TILDE])
def test_tilde_in_an_option_value_is_the_home_folder(case, argv, written, w, tmp_path, monkeypatch):
    import shutil

    home = tmp_path / "home"
    shutil.copytree(w / "draft", home / "draft")
    shutil.copytree(w / "target", home / "target")
    for f in ("trace.jsonl", "sps.json", "sps.sglang.json", "prompts.txt"):
        shutil.copy(w / f, home / f)
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    res = runner.invoke(app, [a.replace("{r}", str(w)) for a in argv])
    assert res.exit_code == 0, f"{case}: {res.output[-600:]}"
    assert not (work / "~").exists(), f"{case}: wrote into a folder named '~'"
    if written:
        assert (home / written).is_file()


def test_set_name_overrides_the_recipe_name(w):
    from dsparkctl.train.recipe import load_recipe

    assert load_recipe(w / "recipe.toml", ["name=other"]).name == "other"


# ------------------------------------------------------------------ a folder where a lock file goes
def test_lock_path_that_is_a_folder_is_one_line(w, tmp_path, monkeypatch):
    from dsparkctl.train.job import run_dir_for
    from dsparkctl.train.recipe import load_recipe

    cache = tmp_path / "cache"
    run_dir = run_dir_for(load_recipe(w / "recipe.toml"), cache)
    (run_dir / "run.lock").mkdir(parents=True)
    res = runner.invoke(app, ["train", str(w / "recipe.toml"), "--cache-dir", str(cache)])
    errors = [m for m in res.stderr.splitlines() if "error" in m]
    assert res.exit_code == 2 and len(errors) == 1, res.output[-600:]
    assert "is a folder" in errors[0] and "(fix: " in errors[0], errors[0]


@pytest.mark.parametrize("how", ["claim", "refuse_if_held", "wait_for"])
def test_lock_functions_refuse_a_folder(how, tmp_path):
    from dsparkctl import locks
    from dsparkctl.errors import InputError

    lock = tmp_path / "part_00000.lock"
    lock.mkdir()
    call = {"claim": lambda: locks.claim(lock), "refuse_if_held": lambda: locks.refuse_if_held(lock, "x"),
            "wait_for": lambda: locks.wait_for(lock, lambda: False, "x", log=lambda m: None, limit_s=0.1)}[how]
    with pytest.raises(InputError, match="is a folder"):
        call()
    assert lock.is_dir()


def test_short_lock_waits_are_said_in_seconds(tmp_path):
    """A live holder (pid 1, as `me()` would name it) waited for 0.3 s: "0.3 s", not "0 min"."""
    from dsparkctl import locks
    from dsparkctl.errors import InputError

    lock = tmp_path / "x.lock"
    owner = {**locks.me(), "pid": 1, "start": locks._start_ticks(1)}
    if owner["start"] is None:
        pytest.skip("no /proc")
    lock.write_text(json.dumps(owner))
    logs: list[str] = []
    with pytest.raises(InputError) as e:
        locks.wait_for(lock, lambda: False, "x", log=logs.append, poll=0.05, limit_s=0.3)
    assert "at most 0.3 s" in logs[0] and " min" not in logs[0], logs
    assert " s (" in e.value.message and " min" not in e.value.message, e.value.message


# ------------------------------------------------------------------ unreadable weights are not missing
@pytest.mark.parametrize("which", ["draft", "target"])
def test_unreadable_weights_say_unreadable(which, w, monkeypatch):
    """chmod 000 cannot stop root (the tests' user); os.access says what a user without the permission sees."""
    bad = str(w / which / "model.safetensors")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if str(p) == bad else real(p, mode, **k))
    res = runner.invoke(app, [a.replace("{r}", str(w)) for a in GEN] + ["hi"])
    errors = [m for m in res.stderr.splitlines() if "error" in m]
    assert res.exit_code == 2 and len(errors) == 1, res.output[-600:]
    assert "is not readable (permission denied)" in errors[0] and "chmod u+r" in errors[0], errors[0]
    assert "download" not in errors[0]


# ------------------------------------------------------------------ calibrate's fit warnings name the cause
WARNINGS = [  # (fit report entry, temperature, what the warning must say, what it must not)
    ({"position": 4, "trials": 0, "successes": 0, "status": "too few"}, 1.0, "no recorded round reached", "bias"),
    ({"position": 2, "trials": 120, "successes": 0, "status": "too few"}, 1.0, "all 120 trials were rejected",
     "too few"),
    ({"position": 1, "trials": 90, "successes": 90, "status": "too few"}, 1.0, "all 90 trials were accepted",
     "too few"),
    ({"position": 3, "trials": 30, "successes": 4, "status": "too few"}, 1.0, "only 30 trials (4 accepted), 50 needed",
     "bias"),
    ({"position": 2, "trials": 110, "successes": 1, "status": "edge"}, 20.0, "only 1 of 110 trials were accepted",
     "bias"),
    ({"position": 2, "trials": 110, "successes": 107, "status": "edge"}, 0.05, "only 3 of 110 trials were rejected",
     "bias"),
    ({"position": 1, "trials": 120, "successes": 60, "status": "edge"}, 20.0, "off by a bias", "too few"),
]


@pytest.mark.parametrize("entry,t,says,not_says", WARNINGS)
def test_fit_warnings_name_what_happened(entry, t, says, not_says):
    from dsparkctl.tuning.calibration import fit_warning

    text = fit_warning(entry, t)
    assert text.startswith(f"position {entry['position']}: ") and says in text and not_says not in text, text


def test_calibrate_warns_of_the_actual_cause(w, tmp_path):
    trace = tmp_path / "one.jsonl"  # every draft accepted at position 1 of a few requests: too few, not a bias
    write_synthetic_trace(trace, SyntheticModel(), 12, 3, seed=5)
    res = runner.invoke(app, ["calibrate", str(trace), "--out", str(tmp_path / "c.json"), "--json"])
    assert res.exit_code == 0, res.output[-600:]
    for text, fit in zip(json.loads(res.stdout)["warnings"], json.loads(res.stdout)["fit"]):
        if fit["trials"] < 50:
            assert "50 needed" in text or "no recorded round" in text, text


# ------------------------------------------------------------------ the audit table at 80 columns
def test_audit_table_keeps_numbers_whole_at_80_columns():
    from rich.console import Console

    from dsparkctl.cli.schedule import audit_table

    row = {"policy": "dspark-async", "setting": "appendix-a+plain", "rounds": 100000, "first_stat": 123.456,
           "first_p": 0.000123, "pair_stat": 2.5, "pair_p": 0.516, "p_token0": 0.69812, "p_token0_ci": [0.66883, 0.72565],
           "target_token0": 0.7, "mean_verify": 2.25, "claimed_lossless": False, "drafted_share": 0.5, "verdict": "fail"}
    report = {"alpha": 0.001, "results": [row, {**row, "policy": "static:2", "verdict": "pass",
                                                "claimed_lossless": True}]}
    for width in (80, 100):
        buf = io.StringIO()
        Console(file=buf, width=width, color_system=None).print(audit_table(report))
        text = buf.getvalue()
        assert "…" not in text, text
        for number in ("100000", "0.6981", "[0.6688, 0.7257]", "0.700", "123.5", "(0.000123)", "2.5", "(0.516)",
                       "2.25", "50%"):
            assert number in text, f"{number} cut at {width} columns:\n{text}"


# ------------------------------------------------------------------ a terminal that cannot print UTF-8
def _cli(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-m", "dsparkctl", *args], capture_output=True, cwd=cwd, env=full,
                          timeout=timeout)


ENCODINGS = [  # (case, argv, environment, exit code)
    ("calibrate to a non-ASCII path, ASCII stdout", ["calibrate", "{r}/trace.jsonl", "--out", "{t}/calé.json"],
     {"PYTHONIOENCODING": "ascii"}, 0),
    ("generate a non-ASCII prompt, ASCII stdout", [*GEN, "héllo ∑ wörld"], {"PYTHONIOENCODING": "ascii"}, 0),
    ("generate a CJK prompt, latin-1 stdout", [*GEN, "你好"], {"PYTHONIOENCODING": "latin-1"}, 0),
    ("an error naming a non-ASCII path, ASCII stderr", ["calibrate", "{t}/naïve.jsonl"], {"PYTHONIOENCODING": "ascii"}, 2),
    ("--help, ASCII stdout", ["generate", "--help"], {"PYTHONIOENCODING": "ascii"}, 0),
    ("inspect a draft under a non-ASCII folder, C locale", ["inspect", "{t}/dräft"], {"LC_ALL": "C",
                                                                                      "PYTHONIOENCODING": "ascii"}, 0),
]


@pytest.mark.parametrize("case,argv,env,code", ENCODINGS, ids=[c[0] for c in ENCODINGS])
def test_printing_never_fails(case, argv, env, code, w, tmp_path):
    import shutil

    shutil.copytree(w / "draft", tmp_path / "dräft")
    res = _cli([a.replace("{r}", str(w)).replace("{t}", str(tmp_path)) for a in argv], env, tmp_path)
    stderr = res.stderr.decode("ascii", "replace")
    assert res.returncode == code, f"{case}: {res.returncode}\n{stderr[-800:]}"
    assert "internal error" not in stderr and "Traceback" not in stderr, stderr[-800:]


# ------------------------------------------------------------------ a hub id that is no local folder, offline
OFFLINE = [
    ("generate --draft org/name, hub unreachable", [*GEN[:3], "--draft", "myorg/mydraft", "--no-chat", "hi"],
     {"HF_ENDPOINT": "http://127.0.0.1:9"}),
    ("generate --target org/name, hub unreachable", ["generate", "--target", "myorg/mytarget", "--no-chat", "hi"],
     {"HF_ENDPOINT": "http://127.0.0.1:9"}),
    ("inspect org/name, hub unreachable", ["inspect", "myorg/mydraft"], {"HF_ENDPOINT": "http://127.0.0.1:9"}),
    ("generate --draft org/name, HF_HUB_OFFLINE=1", [*GEN[:3], "--draft", "myorg/mydraft", "--no-chat", "hi"],
     {"HF_HUB_OFFLINE": "1"}),
]


@pytest.mark.parametrize("case,argv,env", OFFLINE, ids=[c[0] for c in OFFLINE])
def test_missing_folder_that_looks_like_a_hub_id_fails_fast_offline(case, argv, env, w, tmp_path):
    t0 = time.monotonic()
    res = _cli([a.replace("{r}", str(w)) for a in argv], {**env, "HF_HOME": str(tmp_path / "hf")}, tmp_path, timeout=60)
    took = time.monotonic() - t0
    stderr = res.stderr.decode()
    assert res.returncode not in (0, 1), f"{case}: {res.returncode}\n{stderr[-800:]}"
    assert len(stderr.strip().splitlines()) == 1 and "(fix: " in stderr, f"{case}: {stderr[-1200:]!r}"
    assert took < 15, f"{case}: took {took:.0f} s"
