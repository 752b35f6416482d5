"""Local inspect/extract over miniature checkpoints of every known layout."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from dsparkctl.checkpoint import extract as extract_mod
from dsparkctl.checkpoint import shard_stream as stream_mod
from dsparkctl.checkpoint.fixtures import FIXTURE_LAYOUTS, write_fixture
from dsparkctl.checkpoint.layouts import LAYOUTS, detect
from dsparkctl.checkpoint.quant import dequant_fp4, dequant_fp8
from dsparkctl.checkpoint.source import open_local
from dsparkctl.cli import console
from dsparkctl.cli.main import app


@pytest.fixture(autouse=True)
def _one_line_errors(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


def run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("layout", FIXTURE_LAYOUTS)
def test_inspect_detects_layout_and_extract_copies_bytes(layout, tmp_path: Path):
    src = write_fixture(tmp_path / "src", layout)
    r = run("inspect", str(src), "--json")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["layout"]["key"] == layout
    assert not [f for f in report["findings"] if f["level"] == "error"]

    out = tmp_path / "out"
    r = run("extract", str(src), str(out), "--verify", "--json")
    assert r.exit_code == 0, r.stderr
    ckpt, draft = open_local(src), open_local(out)
    assert draft.layout.key == layout
    assert sorted(draft.weight_map) == sorted(ckpt.draft_names())
    for name in draft.weight_map:  # byte-identical copies
        a, b = ckpt.tensor(name), draft.tensor(name)
        with open(src / a.file, "rb") as fa, open(out / b.file, "rb") as fb:
            fa.seek(a.start), fb.seek(b.start)
            assert fa.read(a.nbytes) == fb.read(b.nbytes), name
    cfg = json.loads((out / "config.json").read_text())
    shas = cfg["provenance"]["source_shards_sha256"]
    for file, sha in shas.items():
        assert hashlib.sha256((src / file).read_bytes()).hexdigest() == sha
    assert cfg["provenance"]["tool"] == "dsparkctl" and cfg["dspark_draft"]["layout"] == layout


def test_v41_counts_components_and_download_cost(tmp_path: Path):
    report = json.loads(run("inspect", str(write_fixture(tmp_path / "s", "v4.1-flash")), "--json").stdout)
    assert report["stages"] == 3
    assert [s["file"] for s in report["draft_shards"]] == [f"model-0000{i}-of-00008.safetensors" for i in (5, 6, 7)]
    experts = next(c for c in report["components"] if c["component"] == "stage 0 / routed experts")
    # 8 experts x (w1 [32, 32] + w3 [32, 32] + w2 [64, 16]) I8 bytes, FP4 counts two per byte
    assert experts["params"] == 8 * 2 * (32 * 32 + 32 * 32 + 64 * 16)
    assert report["download"]["draft_only_bytes"] < report["download"]["total_bytes"]


def test_0731_warns_about_stage_count(tmp_path: Path):
    report = json.loads(run("inspect", str(write_fixture(tmp_path / "s", "v4-flash-dspark-0731")), "--json").stdout)
    warn = [f for f in report["findings"] if f["level"] == "warning"]
    assert warn and warn[0]["check"] == "stages"


@pytest.mark.parametrize("field,value,check", [
    ("dspark_markov_rank", 99, "markov_rank"),
    ("dspark_noise_token_id", 10**6, "noise_token"),
    ("dspark_target_layer_ids", [1, 2, 40], "target_layers"),
    ("dspark_block_size", None, "block_size"),
])
def test_consistency_errors_are_reported_and_block_extract(field, value, check, tmp_path: Path):
    src = write_fixture(tmp_path / "s", "v4.1-flash")
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"][field] = value
    (src / "config.json").write_text(json.dumps(cfg))
    report = json.loads(run("inspect", str(src), "--json").stdout)
    assert any(f["level"] == "error" and f["check"] == check for f in report["findings"])
    r = run("extract", str(src), str(tmp_path / "out"))
    assert r.exit_code != 0 and not (tmp_path / "out").exists()


def test_wrong_block_size_flags_scales(tmp_path: Path):
    src = write_fixture(tmp_path / "s", "v4.1-flash")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [128, 128]
    (src / "config.json").write_text(json.dumps(cfg))
    report = json.loads(run("inspect", str(src), "--json").stdout)
    assert any(f["level"] == "error" and f["check"] == "scales" for f in report["findings"])


def test_pro_is_told_from_0731_by_hidden_size():
    names = ["mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w1.weight"]
    assert detect(names, {"mtp.0.main_proj.weight": (7168, 21504)}, "x").key == "v4-pro-dspark"
    assert detect(names, {"mtp.0.main_proj.weight": (4096, 12288)}, "x").key == "v4-flash-dspark-0731"
    assert len(LAYOUTS) == 6


def test_dequantize_bf16_matches_library_and_drops_scales(tmp_path: Path):
    src = write_fixture(tmp_path / "s", "v4.1-flash")
    out = tmp_path / "out"
    r = run("extract", str(src), str(out), "--dequantize", "bf16", "--max-shard-size", "100KB", "--verify")
    assert r.exit_code == 0, r.stderr
    draft, ckpt = open_local(out), open_local(src)
    assert not [n for n in draft.weight_map if n.endswith(".scale")]
    assert len(draft.headers) > 1
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dspark_draft"]["dequantized"] == "bf16"

    def load(folder: Path, ck, name: str) -> torch.Tensor:
        with safe_open(folder / ck.weight_map[name], "pt") as f:
            return f.get_tensor(name)

    for name, fn in [("mtp.0.attn.wq_a.weight", lambda w, s: dequant_fp8(w, s, (32, 32))),
                     ("mtp.1.ffn.experts.3.w2.weight", dequant_fp4)]:
        want = fn(load(src, ckpt, name), load(src, ckpt, name.replace(".weight", ".scale")))
        got = load(out, draft, name)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_with_head_takes_embed_and_head(tmp_path: Path):
    src = write_fixture(tmp_path / "s", "v4.1-flash")
    out = tmp_path / "out"
    assert run("extract", str(src), str(out), "--with-head").exit_code == 0
    assert {"embed.weight", "head.weight"} <= set(open_local(out).weight_map)


def test_existing_out_is_refused(tmp_path: Path):
    src = write_fixture(tmp_path / "s", "deepspec-dspark")
    (tmp_path / "out").mkdir()
    r = run("extract", str(src), str(tmp_path / "out"))
    assert r.exit_code != 0 and "already exists" in r.stderr


def test_interrupted_extract_leaves_no_out(tmp_path: Path, monkeypatch):
    src = write_fixture(tmp_path / "s", "v4.1-flash")
    calls = []

    def boom(*a, **k):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    real = extract_mod._dequant
    monkeypatch.setattr(extract_mod, "_dequant", boom)
    r = run("extract", str(src), str(tmp_path / "out"), "--dequantize", "bf16")
    assert r.exit_code == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def _assert_same_draft(src: Path, out: Path) -> None:
    ckpt, draft = open_local(src), open_local(out)
    assert sorted(draft.weight_map) == sorted(ckpt.draft_names())
    for name in draft.weight_map:
        a, b = ckpt.tensor(name), draft.tensor(name)
        with open(src / a.file, "rb") as fa, open(out / b.file, "rb") as fb:
            fa.seek(a.start), fb.seek(b.start)
            assert fa.read(a.nbytes) == fb.read(b.nbytes), name
    shas = json.loads((out / "config.json").read_text())["provenance"]["source_shards_sha256"]
    assert shas == {f: hashlib.sha256((src / f).read_bytes()).hexdigest() for f in shas}


@pytest.mark.parametrize("chunk,max_shard,fadvise", [
    (4096, 5_000_000_000, True),  # many chunks per segment, one output shard, writeback kicked often
    (4096, 60_000, True),  # segments cut where an output shard ends; shards fed by several workers
    (1 << 20, 60_000, False),  # no posix_fadvise (non-Linux): writeback is left to the final fsync
])
def test_parallel_stream_writes_every_byte_at_its_offset(chunk, max_shard, fadvise, tmp_path: Path, monkeypatch):
    src = write_fixture(tmp_path / "s", "v4.1-flash")
    monkeypatch.setattr(stream_mod, "STREAM_CHUNK", chunk)
    monkeypatch.setattr(stream_mod, "WRITEBACK_STEP", 3 * 4096)
    if not fadvise:
        monkeypatch.delattr(stream_mod.os, "posix_fadvise")
    seen = []
    res = extract_mod.extract(open_local(src), tmp_path / "out", max_shard_size=max_shard, verify=True,
                              on_bytes=seen.append)
    assert res.verified and (len(res.shards) > 1) == (max_shard < 1e6)
    _assert_same_draft(src, tmp_path / "out")
    # progress counts every byte of every source shard read, once
    assert sum(seen) == sum((src / f).stat().st_size for f in res.source_shards)
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in (tmp_path / "out").iterdir())


def test_mixed_copy_and_dequantize_in_one_run(tmp_path: Path):
    """Workers copy while this thread dequantizes; offsets of both kinds interleave in one shard."""
    src = write_fixture(tmp_path / "s", "v4.1-flash")
    res = extract_mod.extract(open_local(src), tmp_path / "out", dequantize=True, verify=True)
    draft = open_local(tmp_path / "out")
    assert res.verified and len(draft.headers) == 1
    assert {t.dtype for t in draft.headers[res.shards[0]].tensors.values()} >= {"BF16", "F32"}


def test_shard_truncated_while_streaming_fails_and_leaves_nothing(tmp_path: Path, monkeypatch):
    src = write_fixture(tmp_path / "s", "v4.1-flash")
    real = extract_mod.open_source

    def open_then_truncate(ckpt, file):
        fd = real(ckpt, file)  # passes the size check, then the file shrinks under the worker
        if file == "model-00006-of-00008.safetensors":
            os.truncate(src / file, (src / file).stat().st_size - 100)
        return fd

    monkeypatch.setattr(extract_mod, "open_source", open_then_truncate)
    r = run("extract", str(src), str(tmp_path / "out"))
    assert r.exit_code != 0 and "model-00006-of-00008.safetensors: truncated at byte" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_verify_catches_a_byte_written_wrong(tmp_path: Path, monkeypatch):
    src = write_fixture(tmp_path / "s", "v4.1-flash")
    real = stream_mod.ShardOutput.pwrite
    hit = []

    def flip_once(fd, data, offset):
        view = memoryview(data).cast("B")
        if not hit and offset > 4096 and len(view) > 16:  # a tensor write, not a header
            hit.append(offset)
            bad = bytearray(view)
            bad[7] ^= 0xFF
            return real(fd, bad, offset)
        return real(fd, data, offset)

    monkeypatch.setattr(stream_mod.ShardOutput, "pwrite", staticmethod(flip_once))
    r = run("extract", str(src), str(tmp_path / "out"), "--verify")
    assert hit and r.exit_code != 0 and "does not match its source bytes" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
