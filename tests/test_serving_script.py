"""Generated scripts are inert (issue 20, class 1): every value written into serve-config's
script or printed command passes `serving.shell_word` (control characters refused, the rest
quoted), so a folder name can neither break out of a quoted word nor end a comment line; a
--target-id that looks like an option is refused."""

from __future__ import annotations

import subprocess

import pytest
from typer.testing import CliRunner

from dsparkctl.cli import common
from dsparkctl.cli.main import app
from dsparkctl.errors import InputError
from dsparkctl.serving import shell_line, shell_word
from tests.helpers import snapshot
from tests.tiny_models import save_tiny_target, write_deepspec_draft

runner = CliRunner()


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(common.err, "soft_wrap", True)


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\x1b[2Jb", "a\x00b", "a\u2028b", "a\u0085b", "a\tb", "a\x7fb"])
def test_control_characters_never_reach_a_script(value):
    with pytest.raises(InputError, match="control character"):
        shell_word(value)


@pytest.mark.parametrize("value", ["plain", "with space", "it's", "$(touch PWNED)", "`touch PWNED`", "; touch PWNED",
                                   "--help", "* ? [a]", "é ü 中", "a\\b", '"q"'])
def test_any_other_value_stays_one_inert_word(tmp_path, value):
    line = shell_line({"X": value}, ["printf", "%s|", value])
    out = subprocess.run(["bash", "-c", f"# {line}\n{line}"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == f"{value}|" and not (tmp_path / "PWNED").exists()


@pytest.fixture()
def models(tmp_path):
    return save_tiny_target(tmp_path / "target", "llama"), write_deepspec_draft(tmp_path / "draft", block_size=4)


@pytest.mark.parametrize("case,argv,message", [
    ("target folder named with a newline", ["--target", "{nl}"], "--target"),
    ("draft folder named with a newline", ["--draft", "{nl}"], "--draft"),
    ("target id with a newline", ["--target-id", "a\ntouch PWNED"], "--target-id"),
    ("target id --help", ["--target-id", "--help"], "--target-id '--help' must be"),
    ("target id -x", ["--target-id", "-x"], "not starting with '-'"),
])
def test_serve_config_refuses_what_a_script_cannot_carry(tmp_path, models, case, argv, message):
    target, draft = models
    nl = tmp_path / "evil\ntouch PWNED\n#"
    if "{nl}" in argv:
        (target if argv[0] == "--target" else draft).rename(nl)
        if argv[0] == "--target":
            target = nl
        else:
            draft = nl
    base = {"--target": str(target), "--draft": str(draft)}
    base.update({argv[0]: argv[1].replace("{nl}", str(nl))})
    args = ["serve-config", "--out", str(tmp_path / "serve.sh")] + [x for kv in base.items() for x in kv]
    before = snapshot(tmp_path)
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "error:" in r.output and r.output.count("\n") == 1, r.output
    assert snapshot(tmp_path) == before and not (tmp_path / "serve.sh").exists()


def test_a_script_with_odd_but_legal_names_runs_nothing_else(tmp_path, models):
    target, draft = models
    odd = tmp_path / "my $(touch PWNED) 'draft'; touch PWNED"
    draft.rename(odd)
    script = tmp_path / "serve.sh"
    r = runner.invoke(app, ["serve-config", "--target", str(target), "--draft", str(odd), "--out", str(script)])
    assert r.exit_code == 0, r.output
    # run the script with `python` replaced by a no-op that prints its arguments
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done\n")
    (tmp_path / "bin" / "python").chmod(0o755)
    out = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
    assert out.returncode == 0 and str(odd) in out.stdout.splitlines() and not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("rows,swept,notes", [
    ([(1, 4), (2, 4), (4, 3), (8, 2), (16, 1)], 4,
     ["vLLM's length table: the sweep covered concurrency 1..16; batch sizes 17..1024 reuse the length at 16 (1)"]),
    ([(1, 2), (4, 2), (16, 2)], 4,
     ["vLLM's length table: the sweep covered concurrency 1..16; batch sizes 17..1024 reuse the length at 16 (2)"]),
    ([(1, 2), (16, 2)], 6, ["the sweep was run for block size 6, this draft's is 4",
                            "the sweep covered concurrency 1..16; batch sizes 17..1024 reuse the length at 16"]),
])
def test_sweep_notes_name_the_right_range_and_another_block_size(rows, swept, notes):
    from dsparkctl.serving import k_table_from_sweep, sweep_notes

    sweep = {"format": "dsparkctl-sweep/1", "block_size": swept,
             "rows": [{"policy": f"static:{k}", "concurrency": c, "throughput_tok_s": 1.0} for c, k in rows]}
    got = sweep_notes(sweep, 4, k_table_from_sweep(sweep, 4))
    assert len(got) == len(notes) and all(n in g for n, g in zip(notes, got)), got
