"""The documented workflows run as written, and a trace recorded for tuning can be used for it.

1. Traces for calibrate and sweep-scheduler (issue 28, "the documented workflow"): `generate --trace`
   without --policy records with static:γ (every position verified) and says so; with a policy that
   skips the draft or verifies fewer positions it says what the trace lacks; calibrate and
   sweep-scheduler name the real cause of a trace they cannot use (none recorded, the draft
   skipped, nothing verified, the budget) and the fix. Tables of tries, one row each.

2. Every command in a fenced block of README.md, docs/*.md and recipes/README.md runs as written
   (`DOCS` from tests/test_doc_synopsis.py; the markdown is parsed here, so a doc change is tested
   the next time this runs). A page's commands run in document order in one scratch folder, so a
   page's sequence (generate --trace, then calibrate, then sweep-scheduler, then serve-config) is
   one workflow. Substituted, and only these: the embedded target and the shipped draft by a tiny
   pair (`tiny_pair`: the real pair takes minutes), placeholders (DRAFT, `<previous>`, drafts/stageN)
   by the tiny draft, `/tmp/fx…` by the scratch folder, a hub id by a loopback hub
   (tests/test_checkpoint_hub.FakeHub), `make X` by its recipe's commands (without `setup`).
   Synopses (`[--flag]` forms) and example output are not commands. A command that cannot run
   offline or in a test is in `EXCLUDED` with its reason; an excluded entry that matches nothing fails.

3. `benchmarks/interop_check.sh` removes only folders it made: a run with a stand-in interpreter
   (no downloads, no venvs) over folders a user owns.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.formats.trace import TraceRound, TraceWriter, read_trace
from tests.test_doc_synopsis import DOCS, ROOT, fenced_blocks
from tests.tiny_models import save_tiny_target, write_deepspec_draft

runner = CliRunner()


def cli(*args, cwd: Path | None = None):
    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        return runner.invoke(app, [str(a) for a in args])
    finally:
        os.chdir(old)


def _reduced_draft(folder: Path) -> Path:
    """The shipped draft's shape in miniature, for the docs' commands: γ = 5, a confidence head and a
    reduced vocabulary (32 of the tiny target's 64 ids), so serve-config's exports apply."""
    import torch

    from dsparkctl.models.draft_io import random_draft, save_draft
    from dsparkctl.models.target import TargetAdapter
    from tests.tiny_models import tiny_target

    tgt = TargetAdapter(tiny_target("qwen3"), [0, 1])
    d = random_draft(tgt, num_layers=1, layer_ids=[0, 1], markov_rank=8, draft_vocab_size=32, block_size=5)
    d.set_draft_vocab(torch.arange(0, 64, 2))
    d.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())
    return save_draft(d, folder)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = save_tiny_target(root / "target", "qwen3", vocab=64, layers=4)
    draft = write_deepspec_draft(root / "draft", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4)
    draft5 = _reduced_draft(root / "draft5")  # the shipped draft's stand-in
    own5 = write_deepspec_draft(root / "own5", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=5)  # DRAFT's
    dflash = write_deepspec_draft(root / "dflash", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4,
                                  confidence=False)
    # a step-cost table in which a drafted step costs 1000x a plain one: dspark skips the draft, as the
    # embedded pair's did at batch 8 in the issue
    skip = root / "skip.json"
    skip.write_text(json.dumps({
        "format": "dsparkctl-sps/2", "batch_tokens": [1, 40], "steps_per_sec": [1.0, 0.9], "max_batch_tokens": 40,
        "grid": {"requests": [1, 2, 4, 8], "tokens_per_request": [1, 5], "step_ms": [[1000.0, 1000.0]] * 4,
                 "verify": "padded", "plain_ms": [1.0] * 4}, "measures": "whole-step", "block_size": 4}))
    return {"target": target, "draft": draft, "draft5": draft5, "own5": own5, "dflash": dflash, "skip": skip, "root": root}


# ---------------------------------------------------------------------------------------------
# 1a. generate --trace: what it records, and what it says about it

PROMPTS = ("w1 w2 w3", "w4 w5", "w6", "w7 w8 w9", "w10 w11")

# (try, extra args (None: no --policy), draft, expected policy in the header, stderr must hold / must not
# hold, every round drafted with all γ verified (or budget-capped)). "wrong before": what the old code did.
GENERATE_TRIES = [
    # the case: the default policy skipped the draft at that load -> no usable round (wrong before)
    ("no --policy, a table that makes dspark skip", ["--sps-table", "{skip}"], "draft", "static:4",
     ["--trace without --policy records with static:4"], True),
    # wrong before: dspark recorded, with this machine's table
    ("no --policy, this machine's table", [], "draft", "static:4", ["records with static:4"], True),
    # wrong before: a trace of plain steps and not a word
    ("--policy static:0", ["--policy", "static:0"], "draft", "static:0",
     ["none drafted", "static:0, which never drafts", "--policy static:4"], False),
    # wrong before: silent
    ("--policy static:2 (short verification)", ["--policy", "static:2"], "draft", "static:2",
     ["verifying fewer than 4 drafts", "sweep-scheduler needs every position verified", "--policy static:4"], False),
    # wrong before: silent
    ("--policy dspark, the skipping table", ["--policy", "dspark", "--sps-table", "{skip}"], "draft", "dspark",
     ["policy dspark", "--policy static:4"], False),
    # wrong before: silent (every round drafted, none verified)
    ("--policy threshold:1.0 (verifies nothing)", ["--policy", "threshold:1.0"], "draft", "threshold:1.0",
     ["none verified a draft", "cannot use it", "--policy static:4"], False),
    # wrong before: silent; the fix is longer requests
    ("--max-new-tokens 1 (no rounds at all)", ["--policy", "static:4", "--max-new-tokens", "1"], "draft",
     "static:4", ["holds no rounds", "max_new_tokens 1", "--max-new-tokens N"], False),
    # right before and after: asked for full verification, nothing to say
    ("--policy static:4", ["--policy", "static:4"], "draft", "static:4", [], True),
    # right before and after: a DFlash draft's default is static:γ already
    ("DFlash draft, no --policy", [], "dflash", "static:4", [], True),
]


@pytest.mark.parametrize("name,extra,draft,policy,says,usable", GENERATE_TRIES, ids=[t[0] for t in GENERATE_TRIES])
def test_generate_trace_records_what_tuning_needs(tiny_pair, tmp_path, name, extra, draft, policy, says, usable):
    trace = tmp_path / "t.jsonl"
    args = [a.format(**{k: str(v) for k, v in tiny_pair.items()}) for a in extra]
    if "--max-new-tokens" not in args:
        args += ["--max-new-tokens", "10"]
    res = cli("generate", "--target", tiny_pair["target"], "--draft", tiny_pair[draft], "--no-chat", "--json",
              "--batch-size", "2", "--trace", trace, *args, *PROMPTS)
    assert res.exit_code == 0, res.output
    t = read_trace(trace)
    assert t.header["policy"] == policy and t.header["block_size"] == 4
    assert isinstance(t.header["max_new_tokens"], int)
    for needle in says:
        assert needle in res.stderr, (needle, res.stderr)
    if not says:
        assert "note: " + str(trace) not in res.stderr and "records with" not in res.stderr, res.stderr
    report = json.loads(res.stdout)
    assert ("trace_note" not in report) == usable
    full = bool(t.rounds) and all(r.drafted and (r.verify_length == 4 or r.budget_capped) for r in t.rounds)
    assert full == usable
    if usable and draft == "draft":  # and calibrate takes it (a DFlash draft has no confidences to calibrate)
        cal = cli("calibrate", trace, "--out", tmp_path / "calib.json", "--bins", "2", "--holdout", "0.4")
        assert cal.exit_code == 0, cal.output


# ---------------------------------------------------------------------------------------------
# 1b. calibrate and sweep-scheduler on traces they cannot use: the real cause, the right fix


def _trace(path: Path, header: dict, rounds: list[dict]) -> Path:
    """A trace written by the real writer: `rounds` as (request, round, drafted, verify_length, accepted,
    budget_capped) dicts; confidences for drafted rounds."""
    with TraceWriter(path, header) as w:
        w.write(TraceRound(request=r["req"], round=r["rnd"], block_size=header["block_size"],
                           confidence_logits=[0.5] * header["block_size"] if r.get("drafted", True) else None,
                           verify_length=r.get("ell", header["block_size"]), accepted=r.get("acc", 0),
                           batch_tokens=8, draft_ms=1.0, verify_ms=2.0, budget_capped=r.get("capped", False),
                           drafted=r.get("drafted", True)) for r in rounds)
    return path


def _rounds(n: int, requests: int = 10, **kw) -> list[dict]:
    return [{"req": i % requests, "rnd": i // requests, **kw} for i in range(n)]


H5 = {"block_size": 5, "max_new_tokens": 128}
TRACES = {  # name -> (header, rounds)
    "plain_dspark": ({**H5, "policy": "dspark"}, _rounds(69, drafted=False, ell=0)),  # the trace
    "plain_static0": ({**H5, "policy": "static:0"}, _rounds(40, drafted=False, ell=0)),
    "empty_m1": ({**H5, "policy": "static:5", "max_new_tokens": 1}, []),
    "empty_old": ({"block_size": 5, "policy": "static:5"}, []),  # an older trace: no max_new_tokens
    "verified_none": ({**H5, "policy": "threshold:1.0"}, _rounds(60, ell=0)),
    "good": ({**H5, "policy": "static:5"}, [{**r, "acc": r["rnd"] % 3} for r in _rounds(200)]),
    "mixed_plain_good": ({**H5, "policy": "dspark"},
                         _rounds(30, drafted=False, ell=0) + [{**r, "rnd": r["rnd"] + 3, "acc": r["rnd"] % 4}
                                                              for r in _rounds(200)]),
    "all_capped": ({**H5, "policy": "static:5", "max_new_tokens": 3}, _rounds(20, ell=1, capped=True)),
    "plain_and_capped": ({**H5, "policy": "dspark", "max_new_tokens": 3},
                         _rounds(20, drafted=False, ell=0) + [{**r, "rnd": r["rnd"] + 2} for r in
                                                              _rounds(20, ell=1, capped=True)]),
    "short_dspark": ({**H5, "policy": "dspark"}, [{**r, "ell": 2, "acc": 1} for r in _rounds(100)]),
}

# (try, command, traces, expected exit, stderr must hold). "wrong before" in the comment.
TUNING_TRIES = [
    # wrong before: "the traces contain no rounds (fix: record some with `dsparkctl generate --trace`)"
    ("calibrate: the draft skipped in every step", "calibrate", ["plain_dspark"], 1,
     ["plain_dspark.jsonl holds 69 rounds, none drafted", "policy dspark", "skipped the draft", "--policy static:5"]),
    # wrong before: the same "no rounds"
    ("calibrate: recorded with static:0", "calibrate", ["plain_static0"], 1,
     ["none drafted", "static:0, which never drafts", "--policy static:5"]),
    # wrong before: "record some with generate --trace" (what the user did); the fix is longer requests
    ("calibrate: max_new_tokens 1", "calibrate", ["empty_m1"], 1,
     ["empty_m1.jsonl holds no rounds", "max_new_tokens 1", "--max-new-tokens N"]),
    # right before (no rounds; record some), and still right
    ("calibrate: an older trace without rounds", "calibrate", ["empty_old"], 1, ["holds no rounds"]),
    # wrong before: exit 0 and a calibration of T = 1 everywhere, fitted on nothing
    ("calibrate: drafted, nothing verified", "calibrate", ["verified_none"], 1,
     ["none verified a draft", "threshold:1.0", "--policy static:5"]),
    # right before and after
    ("calibrate: plain steps beside full rounds", "calibrate", ["mixed_plain_good"], 0, []),
    ("calibrate: a useless trace beside a good one", "calibrate", ["plain_dspark", "good"], 0, []),
    # wrong before: "(69 budget-capped rounds skipped)" and "a larger N": they were plain steps
    ("sweep: the draft skipped in every step", "sweep", ["plain_dspark"], 1,
     ["holds 69 rounds, none drafted", "policy dspark", "--policy static:5"]),
    # wrong before: the same
    ("sweep: recorded with static:0", "sweep", ["plain_static0"], 1, ["never drafts", "--policy static:5"]),
    # wrong before: plain steps counted as budget-capped
    ("sweep: plain steps and capped rounds", "sweep", ["plain_and_capped"], 1,
     ["20 without a draft", "20 budget-capped", "policy dspark"]),
    # right before (a larger N) and after
    ("sweep: every round budget-capped", "sweep", ["all_capped"], 1, ["20 budget-capped", "--max-new-tokens"]),
    ("sweep: max_new_tokens 1", "sweep", ["empty_m1"], 1, ["holds no rounds", "--max-new-tokens N"]),
    # right before and after: names the short round and static:5
    ("sweep: dspark's short rounds", "sweep", ["short_dspark"], 1, ["verified 2 of 5 drafts", "--policy static:5"]),
    ("sweep: drafted, nothing verified", "sweep", ["verified_none"], 1, ["verified 0 of 5", "--policy static:5"]),
    ("sweep: plain steps beside full rounds", "sweep", ["mixed_plain_good"], 0, []),
]

SPS = {"format": "dsparkctl-sps/2", "batch_tokens": [1, 60], "steps_per_sec": [50.0, 20.0], "max_batch_tokens": 60,
       "grid": {"requests": [1, 2], "tokens_per_request": [1, 6], "step_ms": [[20.0, 25.0], [30.0, 40.0]],
                "verify": "padded", "plain_ms": [18.0, 25.0]}, "measures": "whole-step", "block_size": 5}


@pytest.mark.parametrize("name,command,traces,code,says", TUNING_TRIES, ids=[t[0] for t in TUNING_TRIES])
def test_tuning_names_the_real_cause(tmp_path, name, command, traces, code, says):
    paths = [_trace(tmp_path / f"{t}.jsonl", *TRACES[t]) for t in traces]
    if command == "calibrate":
        res = cli("calibrate", *paths, "--out", tmp_path / "calib.json", "--bins", "5")
    else:
        (tmp_path / "sps.json").write_text(json.dumps(SPS))
        res = cli("sweep-scheduler", *[a for p in paths for a in ("--trace", p)], "--sps-table", tmp_path / "sps.json",
                  "--policies", "static:1,static:5", "--concurrency", "1,2", "--rounds", "50")
    assert (res.exit_code == 0) == (code == 0), res.output  # code 1: refused (an InputError exits 2)
    if code:
        lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "(fix: " in lines[0], res.stderr
        for needle in says:
            assert needle in lines[0], (needle, lines[0])
        assert "budget-capped rounds skipped" not in lines[0]


# ---------------------------------------------------------------------------------------------
# 2. every documented command, run as written

PROMPT = re.compile(r"^\$ ")
LEAD = r"(?:[A-Z_]+=\S+ )*(?:taskset -c \S+ )?"  # environment and CPU pinning before a command
COMMAND = re.compile(rf"^{LEAD}(?:dsparkctl|make|bash|torchrun|python|\.venv/bin/\w+|cp)(?:\s|$)")
SYNOPSIS = re.compile(r"\[[-A-Z<]|^dsparkctl [a-z-]+ \||\(--")  # `[--flag]`, `[PROMPT ...]`, `a | b` lists


def doc_commands(text: str) -> list[str]:
    """The commands of a page's fenced blocks, in order: continuation lines joined, trailing `# comments`
    dropped. In a block with `$ ` prompts only those lines are commands (the rest is their output); a
    block with a synopsis line (`[--flag]`, `a | b`) is a synopsis, not commands (test_doc_synopsis.py)."""
    found = []
    for block in fenced_blocks(text):
        prompted = any(PROMPT.match(line) for line in block)
        joined: list[str] = []
        for line in block:
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
            else:
                joined.append(line)
        cmds = []
        for line in joined:
            if prompted and not PROMPT.match(line):
                continue
            line = re.sub(r"\s+#\s.*$", "", PROMPT.sub("", line)).strip()
            if COMMAND.match(line):
                cmds.append(line)
        if cmds and not any(SYNOPSIS.search(c) for c in cmds if re.match(rf"{LEAD}dsparkctl", c)):
            found += cmds
    return found


# (page, command prefix, why it does not run here): every entry must match a documented command
EXCLUDED = [
    ("docs/checkpoint.md", "dsparkctl inspect /tmp/fx-spec --target embedded --probe", "measures which conventions "
     "a trained draft's weights fit; the tiny pair's random draft fits none better than another "
     "(tests/test_draft_formats.py runs the probe on the shipped draft)"),
    ("README.md", "make test", "runs this test suite itself (`make test-fast` too)"),
    ("docs/generate.md", "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_identity.py",
     "320 prompts decoded twice (about an hour on one core); the figures table above it is checked against "
     "its files by tests/test_doc_figures.py"),
    ("docs/generate.md", "OMP_NUM_THREADS=1 .venv/bin/dsparkctl generate --dataset mt-bench --limit 24",
     "24 prompts × 128 tokens, twice (minutes): the measurement behind the figures table above it, whose numbers "
     "tests/test_doc_figures.py checks against the files it wrote; generate itself runs in the docs' other examples"),
    ("docs/distributed.md", "torchrun --standalone --nproc-per-node N", "N GPUs and a hub target (ORG/TARGET); "
     "tests/test_distributed.py runs generate, eval-acceptance and train under two torchrun ranks on tiny models"),
    ("docs/distributed.md", "OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2",
     "two ranks of the embedded pair (minutes); tests/test_distributed.py runs the same path on tiny models"),
    ("docs/scheduling.md", "OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/bench_policies.py",
     "a benchmark of the embedded pair under load (tens of minutes)"),
    ("docs/scheduling.md", "python benchmarks/bench_scheduler.py", "a timing benchmark (its figures are this machine's)"),
    ("docs/scheduling.md", "python benchmarks/bench_sweep.py", "a timing benchmark (its figures are this machine's)"),
    ("docs/serving.md", "dsparkctl serve-config --draft DRAFT --target-id ORG/TARGET",
     "written for a draft with the full vocabulary, while DRAFT stands for the shipped (reduced) draft here, whose "
     "§2 files the reduced-vocabulary example after it uses (it runs)"),
    ("docs/serving.md", "dsparkctl profile-sps --server http://gpu-box:8000", "needs a running vLLM or SGLang server; "
     "tests/test_profile_server.py runs it, and the planning commands after it, against a batching server on loopback"),
    ("docs/serving.md", "dsparkctl served responses.jsonl --context-buckets", "reads the responses of a running server "
     "(tests/test_profile_server.py: context buckets from response files)"),
    ("docs/serving.md", "dsparkctl sweep-scheduler --served served.json --sps-table server.json", "plans from the "
     "two files above, which need a running server (tests/test_profile_server.py runs the same plan)"),
    ("docs/serving.md", "dsparkctl serve-config --served served.json --sps-table server.json", "as above"),
    ("docs/serving.md", "bash benchmarks/interop_check.sh", "downloads vLLM and SGLang (~650 MB); its folder "
     "handling is tested below (test_interop_check_removes_only_its_own_folders)"),
    ("docs/train.md", "dsparkctl eval-acceptance --draft <previous>", "a template: <previous> is the draft before "
     "the one just trained (the concrete runs below it are tested)"),
    ("docs/train.md", ".venv/bin/python benchmarks/heldout_splits.py", "reads the held-out splits from the data "
     "caches the stage recipes built (hours of the embedded target); it refuses a recipe whose data is not cached"),
    ("recipes/README.md", "dsparkctl train recipes/smollm2-135m-dspark", "the nine-stage training chain (7.5 hours "
     "on the embedded pair); tests/test_train_run.py trains tiny recipes end to end"),
    ("recipes/README.md", "cp drafts/stage10/", "installs the chain's result into the package"),
    ("recipes/README.md", ".venv/bin/python benchmarks/unseen_prompts.py", "builds prompts from the ShareGPT set "
     "(12,800 answers of the embedded target: hours)"),
    ("recipes/README.md", ".venv/bin/python benchmarks/code_prompts.py", "the repository's venv and script, from "
     "the repository root (tests/test_train_data.py builds data from another dataset's answers)"),
    ("recipes/README.md", "dsparkctl generate --draft drafts/stage10 --prompts-file calibration-prompts.jsonl",
     "reads the prompts of the lines above"),
    ("recipes/README.md", "dsparkctl calibrate trace.jsonl --out dsparkctl/assets/",
     "writes into the package, from the trace of the line above"),
]

PAGES = sorted(str(d.relative_to(ROOT)) for d in DOCS if d.is_file())
FIXTURE_HUB = "deepseek-ai/DeepSeek-V4.1-Flash"  # served by a loopback hub from a dev-fixture of its layout
SHIPPED_DRAFT = "dsparkctl/assets/drafts/smollm2-135m-dspark"


def excluded(page: str, command: str) -> str | None:
    return next((why for p, prefix, why in EXCLUDED if p == page and command.startswith(prefix)), None)


def test_every_documented_command_runs_or_is_excluded_with_a_reason():
    commands = {page: doc_commands((ROOT / page).read_text(encoding="utf-8")) for page in PAGES}
    stale = [(p, prefix) for p, prefix, _ in EXCLUDED if not any(c.startswith(prefix) for c in commands.get(p, []))]
    assert not stale, f"EXCLUDED entries that match no documented command (remove them): {stale}"
    assert sum(len(c) for c in commands.values()) > 20  # the parser finds the docs' commands
    # the sequence is among them, and runs
    serving = commands["docs/serving.md"]
    assert "dsparkctl generate --draft DRAFT --dataset mt-bench --trace t.jsonl" in serving
    assert not excluded("docs/serving.md", "dsparkctl calibrate t.jsonl --out calib.json")


def test_doc_commands_parser():
    text = ("```bash\ndsparkctl a --x 1 \\\n    --y 2   # comment\nmake demo\n```\n"
            "```\n$ dsparkctl b\noutput line\n$ OMP_NUM_THREADS=1 dsparkctl c \\\n    --z\n```\n"
            "```\ndsparkctl d [--flag] [--other]\n```\n```\ndsparkctl/\n  cli/  x\n```\n")
    assert doc_commands(text) == ["dsparkctl a --x 1 --y 2", "make demo", "dsparkctl b",
                                  "OMP_NUM_THREADS=1 dsparkctl c --z"]


def make_recipe(target: str) -> list[str]:
    """The commands of a Makefile target (its `setup` prerequisite left out: it installs packages)."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    out = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        out.append(line.strip())
    return out


@pytest.fixture()
def substituted(tiny_pair, tmp_path, monkeypatch):
    """The tiny pair in place of the embedded target and the shipped draft; quiet hub settings."""
    import dsparkctl.app.convert as convert
    import dsparkctl.app.inspect as inspect
    import dsparkctl.app.preflight as preflight
    import dsparkctl.app.serve_config as serve_config
    import dsparkctl.engine.session as session
    import dsparkctl.models.loading as loading

    for mod in (loading, convert, inspect):
        monkeypatch.setattr(mod, "embedded_target_dir", lambda log=None: tiny_pair["target"])
    for mod in (loading, session, preflight, serve_config, convert, inspect):
        monkeypatch.setattr(mod, "default_draft_dir", lambda: tiny_pair["draft5"])
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return tiny_pair


OUTPUT_FLAGS = {"--out", "--plot", "--trace", "--sglang-out", "--plot-dir", "--export-full-vocab", "--export-vllm"}


def substitute(args: list[str], pair: dict, work: Path) -> list[str]:
    """A repository file an argument names is copied into `work` when the command reads it; one it
    writes (after an output flag) is not: a tracked result is the user's, and refused by the rule
    that only a command's own earlier output is replaced (docs/generate.md, "Outputs")."""
    out = []
    for prev, a in zip([None, *args], args):
        if prev in OUTPUT_FLAGS and "/" in a and (ROOT / a).parent.is_dir():
            (work / a).parent.mkdir(parents=True, exist_ok=True)
            out.append(a)
            continue
        if re.fullmatch(r"drafts/stage\d+", a):  # a draft the user trained
            a = str(pair["own5"])
        elif a in ("DRAFT", SHIPPED_DRAFT, SHIPPED_DRAFT + "/"):  # DRAFT: the shipped draft's stand-in
            a = str(pair["draft5"])
        elif a.startswith("/tmp/fx"):
            a = str(work / a[len("/tmp/"):])
        elif "/" in a and not a.startswith("-") and (ROOT / a).is_file() and not (work / a).exists():
            (work / a).parent.mkdir(parents=True, exist_ok=True)  # a repository file the command reads
            shutil.copy(ROOT / a, work / a)
        elif "/" in a and not a.startswith("-") and (ROOT / a).parent.is_dir() and a.split("/")[0] != "dsparkctl":
            (work / a).parent.mkdir(parents=True, exist_ok=True)  # a repository folder the command writes into
        out.append(a)
    return out


def run_command(command: str, pair: dict, work: Path, monkeypatch) -> None:
    """One documented command, as written, in `work` (see the module docstring for what is substituted)."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        monkeypatch.setenv(name, value)
    if words[:2] == ["taskset", "-c"]:
        words = words[3:]  # CPU pinning: the command itself runs
    if words[0] == "make":
        for line in make_recipe(words[1]):
            run_command(line.replace(".venv/bin/dsparkctl", "dsparkctl"), pair, work, monkeypatch)
        return
    if words[0] == "python":
        res = subprocess.run([sys.executable, *words[1:]], cwd=work, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert res.returncode == 0, f"`{command}` failed:\n{res.stderr[-2000:]}"
        return
    assert words[0] == "dsparkctl", f"no runner for `{command}`: run it here or list it in EXCLUDED with a reason"
    res = cli(*substitute(words[1:], pair, work), cwd=work)
    assert res.exit_code == 0, f"`{command}` exited {res.exit_code}:\n{res.output[-3000:]}"


def serve_hub(monkeypatch, work: Path):
    """A loopback hub serving a dev-fixture of DeepSeek-V4.1-Flash's layout as FIXTURE_HUB."""
    from huggingface_hub import constants

    from tests.test_checkpoint_hub import FakeHub

    res = cli("dev-fixture", work / "hub-fixture", "--layout", "v4.1-flash")
    assert res.exit_code == 0, res.output
    hub = FakeHub(work / "hub-fixture", repo=FIXTURE_HUB)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(work / "hub-cache"))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    return hub


SLOW_PAGES = {"docs/scheduling.md", "docs/train.md", "README.md"}  # 200,000-round calibration, audit, full sets


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PAGES else p for p in PAGES])
def test_documented_commands_run_as_written(page, substituted, tmp_path, monkeypatch):
    commands = [c for c in doc_commands((ROOT / page).read_text(encoding="utf-8")) if not excluded(page, c)]
    if not commands:
        pytest.skip(f"{page} documents no command that runs here (synopses, or every one excluded)")
    work = tmp_path / "work"
    work.mkdir()
    hub = serve_hub(monkeypatch, work) if any(FIXTURE_HUB in c for c in commands) else None
    try:
        for command in commands:
            run_command(command, substituted, work, monkeypatch)
    finally:
        if hub is not None:
            hub.server.shutdown()


# ---------------------------------------------------------------------------------------------
# 3. interop_check.sh removes only what it made

FAKE_PYTHON = """#!/bin/sh
# a stand-in interpreter: `-m venv DIR` makes DIR/bin/{python,pip} that do nothing; anything else does nothing
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"
  for t in python pip; do printf '#!/bin/sh\\nexit 0\\n' > "$3/bin/$t"; chmod +x "$3/bin/$t"; done
fi
exit 0
"""


@pytest.fixture()
def interop(tmp_path):
    """A copy of the script in a stand-in clone (a .venv whose tools do nothing) and a stand-in PYTHON,
    so a whole run takes a second, downloads nothing and builds no real venv."""
    clone = tmp_path / "clone"
    (clone / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "interop_check.sh", clone / "benchmarks" / "interop_check.sh")
    (clone / ".venv" / "bin").mkdir(parents=True)
    for tool in ("python", "dsparkctl"):
        (clone / ".venv" / "bin" / tool).write_text("#!/bin/sh\nexit 0\n")
        (clone / ".venv" / "bin" / tool).chmod(0o755)
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)

    def run(interop_dir: Path) -> subprocess.CompletedProcess:
        env = {**os.environ, "INTEROP_DIR": str(interop_dir), "PYTHON": str(fake)}
        return subprocess.run(["bash", str(clone / "benchmarks" / "interop_check.sh")], env=env, capture_output=True,
                              text=True, timeout=120)
    return run


def _mine(folder: Path, name: str = "notes.txt") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("mine\n")
    return [folder / name]


def _ours(tmp: Path, run) -> Path:
    """An INTEROP_DIR after a finished run: marked, with its venvs and outputs."""
    ours = tmp / "ours"
    assert run(ours).returncode == 0
    assert (ours / ".interop-owner").is_file() and (ours / "outputs" / "profile-sps.out").is_file()
    return ours


def _replaced(tmp: Path, run, name: str, file: str = "notes.txt", marker: str | None = None):
    """Our INTEROP_DIR in which the user's own folder now stands where `name` was."""
    ours = _ours(tmp, run)
    shutil.rmtree(ours / name)
    mine = _mine(ours / name, file)
    if marker is not None:
        (ours / name / ".interop-owner").write_text(marker)
    return ours, mine


# (try, set-up(tmp, run) -> (INTEROP_DIR, the user's files that must survive), refused?)
INTEROP_TRIES = [
    # wrong before: outputs/ and vllm-venv/ of a user's folder removed
    ("a user's folder with outputs/ and vllm-venv/",
     lambda t, run: (t / "d", _mine(t / "d" / "outputs") + _mine(t / "d" / "vllm-venv")), True),
    # wrong before: removed (no .ready: "rebuilt")
    ("a user's vllm-venv in our INTEROP_DIR", lambda t, run: _replaced(t, run, "vllm-venv"), True),
    # wrong before: a stale .ready -> rebuilt -> removed
    ("a user's sglang-venv with another .ready", lambda t, run: _replaced(t, run, "sglang-venv", ".ready"), True),
    # wrong before: removed at the start of every run
    ("a user's outputs/ in our INTEROP_DIR", lambda t, run: _replaced(t, run, "outputs"), True),
    # wrong before: removed; a marker copied from another INTEROP_DIR proves nothing here
    ("outputs/ with another run's marker", lambda t, run: _replaced(t, run, "outputs", marker="0123abcd\n"), True),
    # right before and after: a new folder is made (and marked)
    ("a new INTEROP_DIR", lambda t, run: (t / "new", []), False),
    # right before and after: an empty folder is adopted
    ("an empty INTEROP_DIR", lambda t, run: ((t / "empty").mkdir() or t / "empty", []), False),
    # right before and after: our own outputs are replaced by the next run
    ("our own INTEROP_DIR, run again", lambda t, run: (_ours(t, run), []), False),
]


@pytest.mark.parametrize("name,setup,refused", INTEROP_TRIES, ids=[t[0] for t in INTEROP_TRIES])
def test_interop_check_removes_only_its_own_folders(interop, tmp_path, name, setup, refused):
    target, mine = setup(tmp_path, interop)
    before = {p: p.read_text() for p in mine}
    res = interop(target)
    if refused:
        assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
        assert "was not made by interop_check.sh" in res.stderr and "fix:" in res.stderr, res.stderr
        assert "ok   dsparkctl" not in res.stdout  # refused before any work
    else:
        assert res.returncode == 0, res.stderr
        assert (target / "outputs" / ".interop-owner").read_text() == (target / ".interop-owner").read_text()
        assert (target / "outputs" / "profile-sps.out").is_file()
    for p, text in before.items():
        assert p.is_file() and p.read_text() == text, f"{p} was changed or removed"
