"""The library entries of serve-config and train (`run_serve_config`, `run_train`): each refuses a
bad spec before any model loads, in messages that name the spec's fields; the CLI names them by
its flags (`DsparkError.one_line(names)`, as `cli.guard.guarded` renders them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsparkctl.app.serve_config import ServeSpec, run_serve_config
from dsparkctl.app.train import TrainSpec, run_train
from dsparkctl.errors import DsparkError

NO_MODEL = "/nonexistent/no-such-model"  # loading it would be a different error: none is loaded
NO_TARGET = f'target.model="{NO_MODEL}"'
SERVE_FLAGS = {"draft": "--draft", "out": "--out", "target_id": "--target-id", "export_vllm": "--export-vllm",
               "export_full_vocab": "--export-full-vocab"}
TRAIN_FLAGS = {"overrides": "--set", "out": "--out", "with_embeddings": "--with-embeddings",
               "export_step": "--export-step", "max_minutes": "--max-minutes", "max_steps": "--max-steps"}

# (case, entry, spec, names, text of the message with the fields' names, text with the flags)
CASES = [
    ("serve: random draft", run_serve_config, ServeSpec(draft="random"), SERVE_FLAGS,
     "draft random is an untrained draft", "--draft random is an untrained draft"),
    ("serve: shipped draft, other target", run_serve_config, ServeSpec(target=NO_MODEL), SERVE_FLAGS,
     "serve-config needs draft for this target", "serve-config needs --draft for this target"),
    ("serve: vllm alone", run_serve_config, ServeSpec(export_vllm=Path("{tmp}/v")), SERVE_FLAGS,
     "export_vllm comes with export_full_vocab", "(fix: add --export-full-vocab DIR)"),
    ("serve: target id", run_serve_config, ServeSpec(target_id="-x"), SERVE_FLAGS,
     "target_id '-x' must be", "(fix: e.g. --target-id Qwen/Qwen3-8B)"),
    ("serve: out is a folder", run_serve_config, ServeSpec(out=Path("{tmp}")), SERVE_FLAGS,
     "out {tmp} is a folder", "--out {tmp} is a folder"),
    ("train: embeddings without out", run_train, TrainSpec(overrides=(NO_TARGET,), with_embeddings=True),
     TRAIN_FLAGS, "with_embeddings and export_step need out FOLDER",
     "--with-embeddings and --export-step need --out FOLDER (fix: e.g. --out my-draft)"),
    ("train: minutes", run_train, TrainSpec(overrides=(NO_TARGET,), max_minutes=float("inf")), TRAIN_FLAGS,
     "max_minutes must be a finite number", "--max-minutes must be a finite number"),
    ("train: no steps", run_train, TrainSpec(overrides=(NO_TARGET,), max_steps=0), TRAIN_FLAGS,
     "max_steps must be >= 1, got 0", "--max-steps must be >= 1, got 0"),
    ("train: no minutes", run_train, TrainSpec(overrides=(NO_TARGET,), max_minutes=0.0), TRAIN_FLAGS,
     "max_minutes must be a finite number > 0", "--max-minutes must be a finite number > 0"),
    ("train: override", run_train, TrainSpec(overrides=("nonsense",)), TRAIN_FLAGS,
     "overrides 'nonsense': expected key=value", "--set 'nonsense': expected key=value (fix: e.g. --set draft."),
    ("train: embeddings of a reduced vocabulary", run_train,
     TrainSpec(overrides=(NO_TARGET, "draft.vocab_size=16"), with_embeddings=True, out=Path("{tmp}/d")),
     TRAIN_FLAGS, "with_embeddings writes a DeepSpec draft", "or drop --with-embeddings)"),
]


@pytest.mark.parametrize("case,entry,spec,names,text,flagged", CASES, ids=[c[0] for c in CASES])
def test_refused_before_any_model_loads(case, entry, spec, names, text, flagged, tmp_path: Path):
    fields = {k: Path(str(v).format(tmp=tmp_path)) for k, v in vars(spec).items() if isinstance(v, Path)}
    spec = type(spec)(**{**vars(spec), **fields})
    with pytest.raises(DsparkError) as e:
        entry(spec)
    assert text.format(tmp=tmp_path) in str(e.value), case
    assert flagged.format(tmp=tmp_path) in e.value.one_line(names), case
    from dsparkctl.errors import option

    assert option("x")[0] not in str(e.value) + e.value.one_line(names)  # every mark rendered


@pytest.mark.parametrize("argv,line", [
    (["serve-config", "--draft", "random"], "error: --draft random is an untrained draft: there is nothing to serve "
     "(fix: pass a trained draft folder or hub id (or omit --draft for the shipped one))"),
    (["serve-config", "--out", "{tmp}"], "error: --out {tmp} is a folder"),
    (["train", "--set", "nonsense", "{tmp}/r.toml"], "error: --set 'nonsense': expected key=value "
     "(fix: e.g. --set draft.markov_rank=0)"),
    (["train", "--set", "zz.a=1", "{tmp}/r.toml"], "error: --set zz.…: unknown recipe section 'zz'"),
    (["train", "--export-step", "3", "{tmp}/r.toml"], "error: --with-embeddings and --export-step need --out "
     "FOLDER (fix: e.g. --out my-draft)"),
])
def test_the_command_names_its_flags(argv, line, tmp_path: Path, monkeypatch):
    from typer.testing import CliRunner

    from dsparkctl.cli import console
    from dsparkctl.cli.main import app

    monkeypatch.setattr(console.err, "soft_wrap", True)
    (tmp_path / "r.toml").write_text(f"[target]\nmodel = \"{NO_MODEL}\"\n")
    res = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in argv])
    assert res.exit_code == 2 and line.format(tmp=tmp_path) in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


def test_shared_messages_name_what_each_command_has(tmp_path: Path, monkeypatch):
    """A message from shared code names the input as the running command takes it: generate's
    sampling flags; for train, whose prompt field comes from its recipe, the recipe key (which a
    string can now be set to); a user's path that looks like a mark is printed as given."""
    import json

    from typer.testing import CliRunner

    from dsparkctl.cli import console
    from dsparkctl.cli.main import app
    from tests.helpers import tiny_recipe
    from tests.tiny_models import save_tiny_target

    monkeypatch.setattr(console.err, "soft_wrap", True)
    run = lambda *a: CliRunner().invoke(app, [str(x) for x in a])  # noqa: E731
    for argv, text in ((["--top-p", "0"], "error: --top-p must be in (0, 1], got 0.0"),
                       (["--top-k", "-1"], "error: --top-k must be an integer >= 0, got -1"),
                       (["--temperature", "nan"], "error: --temperature must be a finite number, got nan")):
        res = run("generate", "--target", NO_MODEL, *argv)
        assert res.exit_code == 2 and text in res.output, res.output
    odd = tmp_path / "d\ue000seed\ue000"
    odd.mkdir()
    res = run("generate", "--target", NO_MODEL, "--trace", odd)
    assert res.exit_code == 2 and f"error: --trace {odd} is a folder" in res.output, res.output

    target = save_tiny_target(tmp_path / "t", "llama", vocab=64, layers=4)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"q": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(3, 13)))
    recipe = tmp_path / "r.toml"
    recipe.write_text(tiny_recipe(target, prompts))
    res = run("train", recipe, "--cache-dir", tmp_path / "c")
    assert res.exit_code == 2, res.output
    assert "(fix: name the prompt field with data.field in the recipe)" in res.output, res.output
    assert not (tmp_path / "c").exists()  # nothing made: no data folder, no run folder
    res = run("train", recipe, "--cache-dir", tmp_path / "c", "--set", 'data.field="q"', "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["steps"] == 2
