"""serve-config: SGLang's launch line and vLLM's speculative config, with names read in their source."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from dsparkctl.cli.main import app
from dsparkctl.models.draft_io import load_draft, random_draft, save_draft
from dsparkctl.models.target import TargetAdapter
from dsparkctl.serving import k_table_from_sweep
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
    assert r["sglang"]["env"]["SGLANG_RAGGED_VERIFY_MODE"] == "compact"  # else SGLang ignores both files
    v = r["vllm"]["speculative_config"]
    assert set(v) <= VLLM_FIELDS and v["method"] == "dspark" and v["num_speculative_tokens"] == 4
    assert v["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 7, 3], [8, 15, 2], [16, 1024, 1]]
    text = script.read_text()
    assert "SGLANG_RAGGED_VERIFY_MODE=compact" in text and "--speculative-config" in text


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


def test_reduced_vocabulary_draft_is_served_through_its_full_vocabulary_copy(tmp_path):
    target = save_tiny_target(tmp_path / "target", "qwen3")
    tgt = TargetAdapter(tiny_target("qwen3"), [0, 1])
    d = random_draft(tgt, num_layers=1, layer_ids=[0, 1], markov_rank=8, draft_vocab_size=32, block_size=3)
    keep = torch.arange(0, 64, 2)
    d.set_draft_vocab(keep)
    folder = save_draft(d, tmp_path / "reduced", extra_config={"dsparkctl": {"test": True}})
    args = ["serve-config", "--draft", str(folder), "--target", str(target), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0 and "--export-full-vocab" in res.output
    full_dir = tmp_path / "full"
    res = CliRunner().invoke(app, args + ["--export-full-vocab", str(full_dir)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["draft"] == str(full_dir)
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
