"""Commands check their inputs and outputs before any work (app/preflight.py), as a hostile review of
the finished commands found them wanting (issue 12): outputs that overwrite inputs, serve-config's
unchecked files, late recipe checks. Each case: exit ≠ 0, one `error:` line, and the user's files
as they were. (Loose draft configs: test_draft_config.py; files written 0600: test_draft_io.py;
command-line mistakes printed as a box: test_cli_common.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from tests.helpers import snapshot
from tests.tiny_models import save_tiny_target, write_deepspec_draft

runner = CliRunner()


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("review")
    target = save_tiny_target(root / "target", "llama", vocab=64, layers=4)
    draft = write_deepspec_draft(root / "draft", block_size=4)
    ours = root / "sps.json"  # our table with its SGLang twin, as profile-sps writes them
    base = {"batch_tokens": [1, 2, 4, 8], "steps_per_sec": [50.0, 48.0, 40.0, 30.0], "max_batch_tokens": 8}
    ours.write_text(json.dumps({"format": "dsparkctl-sps/1", **base, "measures": "target-forward",
                                "target": "tiny"}))
    (root / "sps.sglang.json").write_text(json.dumps({"sample_batch_tokens": base["batch_tokens"],
                                                      "sample_steps_per_sec": base["steps_per_sec"],
                                                      "max_batch_tokens": 8}))
    bad = {"decreasing.json": {"sample_batch_tokens": [4, 2], "sample_steps_per_sec": [1.0, 2.0],
                               "max_batch_tokens": 4},
           "short-max.json": {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [5.0, 4.0],
                              "max_batch_tokens": 2},
           "zero-rate.json": {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [5.0, 0.0],
                              "max_batch_tokens": 8},
           "list-sweep.json": [1, 2, 3],
           "neg-sweep.json": {"rows": [{"policy": "static:1", "concurrency": -4, "throughput_tok_s": 10.0}]},
           "row-sweep.json": {"rows": [1]},
           "float-sweep.json": {"rows": [{"policy": "static:1", "concurrency": 2.7, "throughput_tok_s": 10.0}]},
           "sts-dataset.json": {"temperatures": [1.0, 1.0, 1.0, 1.0], "dataset": 7}}
    for name, doc in bad.items():
        (root / name).write_text(json.dumps(doc))
    (root / "notes.txt").write_text("the user's notes\n")
    (root / "ws-differs.json").write_text(json.dumps({"format": "dsparkctl-sps/1", **base, "measures": "whole-step"}))
    (root / "ws-differs.sglang.json").write_text(json.dumps({"sample_batch_tokens": [1, 2, 4, 8],
                                                             "sample_steps_per_sec": [50.0, 48.0, 40.0, 29.0],
                                                             "max_batch_tokens": 8}))
    return {"root": root, "target": target, "draft": draft}


TRAIN = ["train", str(Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-dspark.toml")]
SERVE = ["serve-config", "--target", "{t}", "--draft", "{d}"]
CASES = [
    # outputs inside an input folder would overwrite or corrupt the model
    ("profile --out the draft's config", ["profile-sps", "--target", "{t}", "--draft", "{d}", "--out",
                                          "{d}/config.json"], "inside the input folder"),
    ("profile --sglang-out into the target", ["profile-sps", "--target", "{t}", "--out", "{r}/new.json",
                                              "--sglang-out", "{t}/model.safetensors"], "inside the input folder"),
    ("generate --trace into the draft", ["generate", "--target", "{t}", "--draft", "{d}", "--trace",
                                         "{d}/t.jsonl", "hi"], "inside the input folder"),
    ("eval --out into the target", ["eval-acceptance", "--target", "{t}", "--out", "{t}/e.json"],
     "inside the input folder"),
    # serve-config's files are read as strictly as everywhere else
    ("serve decreasing SPS", [*SERVE, "--sps-table", "{r}/decreasing.json"], "decreasing.json"),
    ("serve max_batch_tokens < last probe", [*SERVE, "--sps-table", "{r}/short-max.json"], "short-max.json"),
    ("serve zero steps/s", [*SERVE, "--sps-table", "{r}/zero-rate.json"], "zero-rate.json"),
    ("serve target-forward table", [*SERVE, "--sps-table", "{r}/sps.json"], "does not time the whole speculative step"),
    ("serve sweep is a list", [*SERVE, "--sweep", "{r}/list-sweep.json"], "the sweep result has no rows"),
    ("serve negative concurrency", [*SERVE, "--sweep", "{r}/neg-sweep.json"], "concurrency < 1"),
    ("serve sweep row not an object", [*SERVE, "--sweep", "{r}/row-sweep.json"], "is not an object"),
    ("serve sweep concurrency a float", [*SERVE, "--sweep", "{r}/float-sweep.json"], "is malformed"),
    ("serve STS dataset not a string", [*SERVE, "--calibration", "{r}/sts-dataset.json"], "'dataset' must be"),
    ("serve no draft for a custom target", ["serve-config", "--target", "{t}"], "needs --draft"),
    ("serve our table whose twin differs", [*SERVE, "--sps-table", "{r}/ws-differs.json"], "hold different tables"),
    ("serve random draft", ["serve-config", "--target", "{t}", "--draft", "random"], "nothing to serve"),
    ("serve target id with a newline", [*SERVE, "--target-id", "a\nb"], "--target-id"),
    ("serve target id empty", [*SERVE, "--target-id", ""], "--target-id"),
    ("serve --out over the user's notes", [*SERVE, "--out", "{r}/notes.txt"], "notes.txt exists and dsparkctl has no record of writing it there; refusing to replace it"),
    # train: the output folder is checked before the target loads
    ("train --out below a file", [*TRAIN, "--out", "{r}/notes.txt/x"], "notes.txt is not a folder"),
    ("train --out a file", [*TRAIN, "--out", "{r}/notes.txt"], "exists and is not a folder"),
    ("train --max-minutes inf", [*TRAIN, "--max-minutes", "inf"], "--max-minutes must be a finite number"),
    ("train all-zero loss weights", [*TRAIN, "--set", "optim.loss_weights=[0, 0, 0]"], "loss_weights are all (nearly) zero"),
    ("train eval.every -1", [*TRAIN, "--set", "eval.every=-1"], "eval.every must be >= 0"),
    ("train init_from a file", [*TRAIN, "--set", "optim.init_from={r}/notes.txt"], "is not a draft folder"),
    ("train init_from a target", [*TRAIN, "--set", "optim.init_from={r}/target"], "unknown draft architectures"),
    ("train --out inside init_from", [*TRAIN, "--set", "optim.init_from={r}/draft", "--out", "{r}/draft/x"],
     "inside the input folder"),
    ("train temperature nan", [*TRAIN, "--set", "data.temperature=nan"], "expected float"),
    ("train layer ids rounded", [*TRAIN, "--set", "draft.layer_ids=[0.9, 1.9]"], "expected tuple"),
    ("train loss weights strings", [*TRAIN, "--set", 'optim.loss_weights=["1", "2", "3"]'], "expected tuple"),
    ("train loss weights denormal", [*TRAIN, "--set", "optim.loss_weights=[1e-320, 0, 0]"], "nearly) zero"),
    ("train seed huge", [*TRAIN, "--set", "optim.seed=99999999999999999999"], "seed"),
    ("train mask token a string", [*TRAIN, "--set", 'draft.mask_token_id="abc"'], "expected"),
    ("train threads huge", [*TRAIN, "--set", "optim.threads=99999999999"], "optim.threads 99,999,999,999 is more than"),
    ("train lr 1e308", [*TRAIN, "--set", "optim.lr=1e308"], "optim.lr 1e+308 is more than 10.0"),
    ("train layers huge", [*TRAIN, "--set", "draft.num_layers=99999999999"], "draft.num_layers 99,999,999,999 is more"),
]


@pytest.mark.parametrize("case,argv,needle", CASES, ids=[c[0] for c in CASES])
def test_refused(case, argv, needle, world, monkeypatch):
    r, t, d = world["root"], world["target"], world["draft"]
    monkeypatch.chdir(r)
    before = snapshot(r)
    res = runner.invoke(app, [a.format(r=r, t=t, d=d) for a in argv])
    assert res.exit_code not in (0, None), f"{case}: exit 0\n{res.output}"
    errors = [m for m in res.stderr.splitlines() if m.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.output, res.output
    assert needle.format(r=r) in errors[0], f"{case}: {needle!r} not in {errors[0]!r}"
    assert snapshot(r) == before, f"{case}: files left or changed"


def test_serve_config_notes_another_draft_and_writes_absolute_paths(world, tmp_path, monkeypatch):
    r = world["root"]
    ours = tmp_path / "ws.json"
    ours.write_text(json.dumps({"format": "dsparkctl-sps/1", "batch_tokens": [1, 8], "steps_per_sec": [9.0, 7.0],
                                "max_batch_tokens": 8, "measures": "whole-step", "draft": "someone-else"}))
    (tmp_path / "ws.sglang.json").write_text(json.dumps({"sample_batch_tokens": [1, 8],
                                                         "sample_steps_per_sec": [9.0, 7.0], "max_batch_tokens": 8}))
    monkeypatch.chdir(r)
    res = runner.invoke(app, ["serve-config", "--target", "target", "--draft", "draft", "--sps-table", str(ours),
                              "--out", str(tmp_path / "serve.sh"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert any("someone-else" in n for n in doc["notes"])
    argv = doc["sglang"]["argv"]
    assert argv[argv.index("--model-path") + 1] == str(world["target"].resolve())
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(world["draft"].resolve())
    assert argv[argv.index("--speculative-dspark-sps-table-path") + 1] == str((tmp_path / "ws.sglang.json").resolve())
    # the script it wrote may be replaced by the next run, and is written with the umask's mode
    again = runner.invoke(app, ["serve-config", "--target", "target", "--draft", "draft",
                                "--out", str(tmp_path / "serve.sh")])
    assert again.exit_code == 0, again.output
