"""The library entries of serve-config and train (`run_serve_config`, `run_train`): each refuses a
bad spec before any model loads, in messages that name the spec's fields; the CLI names them by
its flags (`DsparkError.one_line(names)`, as `cli.common.guarded` renders them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsparkctl.errors import DsparkError
from dsparkctl.serving import ServeSpec, run_serve_config
from dsparkctl.train.run import TrainSpec, run_train

NO_MODEL = "/nonexistent/no-such-model"  # loading it would be a different error: none is loaded
NO_TARGET = f'target.model="{NO_MODEL}"'
SERVE_FLAGS = {"draft": "--draft", "out": "--out", "target_id": "--target-id", "export_vllm": "--export-vllm",
               "export_full_vocab": "--export-full-vocab"}
TRAIN_FLAGS = {"overrides": "--set", "out": "--out", "with_embeddings": "--with-embeddings",
               "export_step": "--export-step", "max_minutes": "--max-minutes"}

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

    from dsparkctl.cli import common
    from dsparkctl.cli.main import app

    monkeypatch.setattr(common.err, "soft_wrap", True)
    (tmp_path / "r.toml").write_text(f"[target]\nmodel = \"{NO_MODEL}\"\n")
    res = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in argv])
    assert res.exit_code == 2 and line.format(tmp=tmp_path) in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
