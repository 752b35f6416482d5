"""`--preset deepspec`: DeepSpec's evaluation settings (eval.py defaults, its HumanEval wrapping),
explicit flags winning over the preset, and local JSONL sets read through `--field turns`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.data.prompts import apply_preset_wrap, load_prompts, with_preset
from dsparkctl.errors import UsageError
from tests.tiny_models import save_tiny_target, write_deepspec_draft


def test_deepspec_defaults_and_explicit_flags_win():
    preset, t, n = with_preset("deepspec", None, None)
    assert (preset.name, t, n, preset.chat) == ("deepspec", 1.0, 2048, True)
    assert with_preset("deepspec", 0.0, 64)[1:] == (0.0, 64)  # the user's flags over the preset's
    assert with_preset(None, None, None)[1:] == (0.0, 128)
    with pytest.raises(UsageError, match="unknown preset 'deepspek'"):
        with_preset("deepspek", None, None)


def test_humaneval_is_wrapped_as_deepspec_does_and_mt_bench_is_not():
    he = load_prompts("humaneval", limit=2)
    wrapped = apply_preset_wrap(with_preset("deepspec", None, None)[0], "humaneval", he)
    for raw, w in zip(he, wrapped):
        assert w.startswith("Write a solution to the following problem and make sure that it passes the tests:\n"
                            "```python\n") and raw in w and w.endswith("\n```")
    mt = load_prompts("mt-bench", limit=2)
    assert apply_preset_wrap(with_preset("deepspec", None, None)[0], "mt-bench", mt) == mt


def test_eval_acceptance_with_the_preset_on_a_local_turns_file(tmp_path):
    target = save_tiny_target(tmp_path / "target", "llama", vocab=64, layers=4)
    draft = write_deepspec_draft(tmp_path / "draft", block_size=4)
    rows = [{"turns": ["hello there", "and a second turn that DeepSpec does not use"]},
            {"turns": ["write a poem"]}]
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(app, ["eval-acceptance", "--target", str(target), "--draft", str(draft),
                                   "--dataset", str(tmp_path / "set.jsonl"), "--field", "turns",
                                   "--preset", "deepspec", "--max-new-tokens", "12", "--mode", "teacher-forced",
                                   "--no-chat", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["preset"] == "deepspec" and doc["temperature"] == 1.0 and doc["max_new_tokens"] == 12
    (ds,) = doc["datasets"].values()
    assert ds["prompts"] == 2  # one prompt per row: the first turn
