"""serve-config (app/serve_config.py, serving/): SGLang's launch line and vLLM's speculative config, with names read in
their source; the scripts it writes are inert (issue 20, class 1)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.errors import InputError
from dsparkctl.models.draft_io import load_draft, random_draft, save_draft
from dsparkctl.models.target import TargetAdapter
from dsparkctl.serving.engines import k_table_from_sweep
from dsparkctl.serving.shell import shell_line, shell_word
from tests.helpers import snapshot
from tests.tiny_models import save_tiny_target, tiny_target, write_deepspec_draft

# flag and field names as found in sglang server_args.py / environ.py and vllm config/speculative.py
SGLANG_FLAGS = {"--model-path", "--speculative-algorithm", "--speculative-draft-model-path",
                "--speculative-dspark-block-size", "--speculative-dspark-sps-table-path",
                "--speculative-dspark-confidence-sts-path", "--speculative-dflash-block-size"}
VLLM_FIELDS = {"method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size"}


@pytest.fixture()
def files(tmp_path):
    target = save_tiny_target(tmp_path / "target", "llama")
    draft = write_deepspec_draft(tmp_path / "draft", block_size=4)
    sps = tmp_path / "sps.sglang.json"
    sps.write_text(json.dumps({"sample_batch_tokens": [1, 2, 4, 8], "sample_steps_per_sec": [50.0, 48.0, 40.0, 30.0],
                               "max_batch_tokens": 8}))
    sts = tmp_path / "calib.sglang-sts.json"
    sts.write_text(json.dumps({"temperatures": [1.2, 1.1, 1.0, 0.9], "num_samples": 100}))
    rows = []
    for c, best in ((1, 4), (2, 4), (4, 3), (8, 2), (16, 1)):
        for k in (1, 2, 3, 4):
            rows.append({"policy": f"static:{k}", "concurrency": c, "throughput_tok_s": 100.0 - abs(k - best)})
        rows.append({"policy": "dspark", "concurrency": c, "throughput_tok_s": 1000.0})
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"format": "dsparkctl-sweep/1", "rows": rows}))
    return dict(target=target, draft=draft, sps=sps, sts=sts, sweep=sweep, tmp=tmp_path)


def test_sglang_and_vllm_commands(files):
    script = files["tmp"] / "serve.sh"
    res = CliRunner().invoke(app, ["serve-config", "--draft", str(files["draft"]), "--target", str(files["target"]),
                                   "--sps-table", str(files["sps"]), "--calibration", str(files["sts"]),
                                   "--sweep", str(files["sweep"]), "--out", str(script), "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    argv = r["sglang"]["argv"]
    assert {a for a in argv if a.startswith("--")} <= SGLANG_FLAGS
    assert argv[argv.index("--speculative-algorithm") + 1] == "DSPARK"
    assert argv[argv.index("--speculative-dspark-block-size") + 1] == "4"
    assert argv[argv.index("--speculative-dspark-sps-table-path") + 1] == str(files["sps"])
    assert argv[argv.index("--speculative-dspark-confidence-sts-path") + 1] == str(files["sts"])
    # else SGLang ignores both files; nothing else: every variable must exist in SGLang 0.5.23's environ.py
    assert r["sglang"]["env"] == {"SGLANG_RAGGED_VERIFY_MODE": "compact"}
    v = r["vllm"]["speculative_config"]
    assert set(v) <= VLLM_FIELDS and v["method"] == "dspark" and v["num_speculative_tokens"] == 4
    assert v["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 7, 3], [8, 15, 2], [16, 1024, 1]]
    assert any("covered concurrency 1..16; batch sizes 17..1024 reuse the length at 16" in n for n in r["notes"])
    text = script.read_text()
    assert "SGLANG_RAGGED_VERIFY_MODE=compact" in text and "--speculative-config" in text
    assert "SGLANG_PREP_IN_CUDA_GRAPH" not in text  # does not exist in SGLang 0.5.23


def test_length_table_note_names_the_sweeps_real_range(files):
    """A sweep whose largest concurrency was 8 is named 1..8 (it was once named by the table's
    last range, "4..1024")."""
    rows = [{"policy": f"static:{k}", "concurrency": c, "throughput_tok_s": 10.0 - abs(k - (4 if c < 4 else 3))}
            for c in (1, 2, 4, 8) for k in (1, 2, 3, 4)]
    files["sweep"].write_text(json.dumps({"format": "dsparkctl-sweep/1", "rows": rows}))
    res = CliRunner().invoke(app, ["serve-config", "--draft", str(files["draft"]), "--target", str(files["target"]),
                                   "--sweep", str(files["sweep"]), "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["vllm"]["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 1024, 3]]
    notes = [n for n in r["notes"] if "length table" in n]
    assert notes == ["vLLM's length table: planned from a sweep that does not name its acceptance source (an older "
                     "dsparkctl)",
                     "vLLM's length table: the sweep covered concurrency 1..8; batch sizes 9..1024 reuse the length "
                     "at 8 (3); sweep higher loads to measure them"]


def test_k_table_merges_equal_neighbours_and_needs_static_policies():
    rows = [{"policy": "static:2", "concurrency": c, "throughput_tok_s": 1.0} for c in (1, 4, 16)]
    assert k_table_from_sweep({"rows": rows}, 5, max_batch_size=64) == [[1, 64, 2]]
    from dsparkctl.errors import InputError
    with pytest.raises(InputError, match="static:K"):
        k_table_from_sweep({"rows": [{"policy": "dspark", "concurrency": 1, "throughput_tok_s": 1.0}]}, 5)


BAD = [
    ("one-probe SPS table", lambda f: f["sps"].write_text(json.dumps(
        {"sample_batch_tokens": [4], "sample_steps_per_sec": [40.0], "max_batch_tokens": 4})), "one probe"),
    ("STS for another γ", lambda f: f["sts"].write_text(json.dumps({"temperatures": [1.0, 1.0]})), "2 temperatures"),
    ("STS with NaN", lambda f: f["sts"].write_text('{"temperatures": [NaN, 1, 1, 1]}'), "NaN"),
    ("unknown architecture", lambda f: (f["draft"] / "config.json").write_text(json.dumps(
        {**json.loads((f["draft"] / "config.json").read_text()), "architectures": ["Gemma4DSparkModel"]})), "Gemma-4"),
]


@pytest.mark.parametrize("name,mutate,message", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_one_line_nothing_written(files, name, mutate, message):
    mutate(files)
    script = files["tmp"] / "serve.sh"
    res = CliRunner().invoke(app, ["serve-config", "--draft", str(files["draft"]), "--target", str(files["target"]),
                                   "--sps-table", str(files["sps"]), "--calibration", str(files["sts"]),
                                   "--out", str(script)])
    assert res.exit_code != 0 and message in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    assert not script.exists()


def _reduced_pair(tmp_path):
    target = save_tiny_target(tmp_path / "target", "qwen3")
    tgt = TargetAdapter(tiny_target("qwen3"), [0, 1])
    d = random_draft(tgt, num_layers=1, layer_ids=[0, 1], markov_rank=8, draft_vocab_size=32, block_size=3)
    keep = torch.arange(0, 64, 2)
    d.set_draft_vocab(keep)
    d.share_target_embeddings(tgt.embed_tokens(), tgt.lm_head())  # the head rows follow the new ids
    folder = save_draft(d, tmp_path / "reduced", extra_config={"dsparkctl": {"test": True}})
    return target, tgt, d, keep, folder


def test_reduced_vocabulary_draft_is_served_through_its_full_vocabulary_copy(tmp_path):
    target, _, d, keep, folder = _reduced_pair(tmp_path)
    args = ["serve-config", "--draft", str(folder), "--target", str(target), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0 and "--export-full-vocab" in res.output and "--export-vllm" in res.output
    full_dir = tmp_path / "full"
    res = CliRunner().invoke(app, args + ["--export-full-vocab", str(full_dir)])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["draft"] == r["sglang"]["draft"] == r["vllm"]["draft"] == str(full_dir)  # vLLM loads the copy too
    assert r["exports"] == {"sglang": str(full_dir)} and any("--export-vllm" in n for n in r["notes"])
    full = load_draft(full_dir, TargetAdapter(tiny_target("qwen3"), [0, 1]))
    assert full.draft_vocab_ids is None and full.markov_head.markov_w2.weight.shape == (64, 8)
    w2 = full.markov_head.markov_w2.weight
    assert torch.count_nonzero(w2[1::2]) == 0  # no Markov bias outside the old subset
    torch.testing.assert_close(w2[keep], d.markov_head.markov_w2.weight.to(w2.dtype), atol=1e-2, rtol=1e-2)


def test_k_table_says_zero_where_plain_decoding_wins():
    """static:0 (no draft) in a sweep: vLLM's table turns speculation off where it wins (k = 0 is valid
    in vllm/v1/spec_decode/dynamic/utils.py)."""
    rows = [{"policy": p, "concurrency": c, "throughput_tok_s": t} for p, c, t in (
        ("static:0", 1, 10.0), ("static:2", 1, 12.0), ("static:0", 8, 50.0), ("static:2", 8, 40.0),
        ("static:0", 32, 90.0), ("static:2", 32, 60.0))]
    assert k_table_from_sweep({"rows": rows}, 5, max_batch_size=64) == [[1, 7, 2], [8, 64, 0]]
def test_reduced_vocabulary_draft_in_vllms_form(tmp_path):
    """vLLM's Qwen3DSparkForCausalLM.load_weights (vllm 0.32.0, models/qwen3_dspark.py) takes a
    reduced draft as `d2t` [K] (target id = draft id + d2t[draft id]) plus `lm_head.weight` [K, H],
    and maps every other name to `model.<name>`: no `draft_vocab_ids`, which it would not know."""
    from safetensors.torch import load_file

    target, tgt, d, keep, folder = _reduced_pair(tmp_path)
    full_dir, vllm_dir = tmp_path / "full", tmp_path / "vllm"
    res = CliRunner().invoke(app, ["serve-config", "--draft", str(folder), "--target", str(target), "--json",
                                   "--export-full-vocab", str(full_dir), "--export-vllm", str(vllm_dir)])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["sglang"]["draft"] == str(full_dir) and r["vllm"]["draft"] == str(vllm_dir)
    assert r["vllm"]["speculative_config"]["model"] == str(vllm_dir) and r["exports"] == {
        "sglang": str(full_dir), "vllm": str(vllm_dir)}
    assert str(vllm_dir) not in r["sglang"]["command"]
    t = load_file(str(vllm_dir / "model.safetensors"))
    K = 32
    assert "draft_vocab_ids" not in t and "embed_tokens.weight" not in t
    assert t["d2t"].dtype == torch.int64 and t["d2t"].shape == (K,)
    assert torch.equal(torch.arange(K) + t["d2t"], keep)  # target = draft id + d2t[draft id]
    head = tgt.lm_head().weight
    assert t["lm_head.weight"].shape == (K, head.shape[1])
    assert torch.equal(t["lm_head.weight"], head[keep].to(torch.bfloat16))  # the target head's rows at our ids
    assert torch.equal(t["markov_head.markov_w2.weight"], d.markov_head.markov_w2.weight.to(torch.bfloat16))
    cfg = json.loads((vllm_dir / "config.json").read_text())
    assert cfg["draft_vocab_size"] == K and cfg["vocab_size"] == 64 and cfg["dsparkctl"]["engine"] == "vllm"
    back = load_draft(vllm_dir, TargetAdapter(tiny_target("qwen3"), [0, 1]))  # we read vLLM's form too
    assert torch.equal(back.draft_vocab_ids, keep)
    # run again: both exports are ours, so they are replaced
    res = CliRunner().invoke(app, ["serve-config", "--draft", str(folder), "--target", str(target), "--json",
                                   "--export-full-vocab", str(full_dir), "--export-vllm", str(vllm_dir)])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("extra, message", [
    (["--export-vllm", "V"], "--export-vllm comes with --export-full-vocab"),
    (["--export-full-vocab", "F", "--export-vllm", "F"], "same path"),
])
def test_export_options_refused_in_one_line(tmp_path, extra, message):
    target, _, _, _, folder = _reduced_pair(tmp_path)
    extra = [str(tmp_path / a) if a in ("V", "F") else a for a in extra]
    res = CliRunner().invoke(app, ["serve-config", "--draft", str(folder), "--target", str(target)] + extra)
    assert res.exit_code != 0 and message in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "V").exists()


def test_full_vocabulary_draft_refuses_exports(files, tmp_path):
    res = CliRunner().invoke(app, ["serve-config", "--draft", str(files["draft"]), "--target", str(files["target"]),
                                   "--export-full-vocab", str(tmp_path / "F")])
    assert res.exit_code != 0 and "reduced-vocabulary drafts" in res.output and not (tmp_path / "F").exists()


# -------- what serve-config writes is inert: every value in its script or printed command passes serving.shell_word
# (control characters refused, the rest quoted)
runner = CliRunner()


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


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
])
def test_sweep_notes_name_the_right_range(rows, swept, notes):  # another block size: test_hostile4_inputs.py
    from dsparkctl.serving.engines import k_table_from_sweep, sweep_notes

    sweep = {"format": "dsparkctl-sweep/1", "block_size": swept,
             "acceptance_source": {"kind": "traces", "files": ["t.jsonl"]},
             "rows": [{"policy": f"static:{k}", "concurrency": c, "throughput_tok_s": 1.0} for c, k in rows]}
    got = sweep_notes(sweep, 4, k_table_from_sweep(sweep, 4))
    notes = ["vLLM's length table: planned from recorded traces (t.jsonl)", *notes]  # the source first, always
    assert len(got) == len(notes) and all(n in g for n, g in zip(notes, got)), got
    sweep["rows"][-1]["beyond_profile"] = 0.25  # steps priced past the SPS table: said, not dropped
    got = sweep_notes(sweep, 4, k_table_from_sweep(sweep, 4))
    assert any("at concurrency 16 the sweep priced steps past" in g for g in got), got


def test_the_sts_twin_beside_the_calibration_wins_and_a_bad_sweep_fails_first(tmp_path, monkeypatch):
    """A calibration names its SGLang twin as calibrate was given it (relative to where it ran):
    the twin beside the file is the one that belongs to it, even when the current folder holds
    another calibration's twin of that name. A sweep without rows is refused while the inputs are
    read, before serve-config loads the models or exports a draft."""
    import json

    from dsparkctl.app.serve_config import read_serve_inputs
    from dsparkctl.errors import InputError
    from dsparkctl.formats.sglang import sglang_file

    mine, other = tmp_path / "mine", tmp_path / "other"
    for d in (mine, other):
        d.mkdir()
        (d / "calib.sglang-sts.json").write_text(json.dumps({"temperatures": [1.0], "which": d.name}))
    (mine / "calib.json").write_text(json.dumps({"format": "dsparkctl-calibration/1",
                                                 "outputs": {"sglang_sts": "calib.sglang-sts.json"}}))
    monkeypatch.chdir(other)
    assert sglang_file(mine / "calib.json", "sts") == mine / "calib.sglang-sts.json"
    (tmp_path / "sweep.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(InputError, match="the sweep result has no rows"):
        read_serve_inputs(None, None, tmp_path / "sweep.json")
