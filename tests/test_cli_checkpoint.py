"""The checkpoint commands (cli/checkpoint.py). Hostile inputs to `inspect`, `download`, `extract`
(issue 12): each case exits non-zero with one line naming the file or field, no traceback, nothing
hangs, and no file of the user's is left or changed. Corrupt safetensors bytes are in
test_safetensors_io.py; this table holds the rest."""

from __future__ import annotations

import json
import os
import signal
import struct
from pathlib import Path
from typing import Callable

import pytest
from huggingface_hub import constants
from typer.testing import CliRunner

from dsparkctl.checkpoint import extract as extract_mod
from dsparkctl.checkpoint.fixtures import write_fixture
from dsparkctl.checkpoint.source import open_local
from dsparkctl.cli import console
from dsparkctl.cli.main import app
from tests.helpers import snapshot

S5 = "model-00005-of-00008.safetensors"  # mtp.0
S6 = "model-00006-of-00008.safetensors"  # mtp.1
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_fixture(tmp_path_factory.mktemp("pristine") / "ckpt", "v4.1-flash")


@pytest.fixture(autouse=True)
def _offline_one_line_no_hang(monkeypatch, tmp_path):
    monkeypatch.setattr(console.err, "soft_wrap", True)  # one line, not hard-wrapped at 80 columns
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no test touches the network
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))

    def hung(*_):
        raise TimeoutError("hung (a FIFO read?)")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# --------------------------------------------------------------------------- mutations
def _split(path: Path) -> tuple[str, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8:8 + n].decode(), raw[8 + n:]


def _write(path: Path, header: str, data: bytes) -> None:
    h = header.encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _fifo(name: str) -> Callable[[Path], None]:
    def mutate(ckpt: Path) -> None:
        (ckpt / name).unlink()
        os.mkfifo(ckpt / name)
    return mutate


def _folder(name: str) -> Callable[[Path], None]:
    def mutate(ckpt: Path) -> None:
        (ckpt / name).unlink()
        (ckpt / name).mkdir()
    return mutate


def _duplicate_tensor(ckpt: Path) -> None:
    """The same tensor name twice in one header (JSON keeps only the last)."""
    header, data = _split(ckpt / S5)
    key = '"mtp.0.attn_norm.weight":'
    start = header.index(key)
    entry = header[start:header.index("}", start) + 1]
    _write(ckpt / S5, "{" + entry + "," + header[1:], data)


def _duplicate_index_entry(ckpt: Path) -> None:
    text = (ckpt / INDEX).read_text()
    (ckpt / INDEX).write_text(text.replace('"weight_map": {', f'"weight_map": {{"mtp.0.attn_norm.weight": "{S6}", ', 1))


def _edit_entry(name: str, **changes) -> Callable[[Path], None]:
    def mutate(ckpt: Path) -> None:
        header, data = _split(ckpt / S5)
        doc = json.loads(header)
        doc[name].update(changes)
        _write(ckpt / S5, json.dumps(doc), data)
    return mutate


def _config(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(ckpt: Path) -> None:
        cfg = json.loads((ckpt / "config.json").read_text())
        fn(cfg)
        (ckpt / "config.json").write_text(json.dumps(cfg))
    return mutate


def _block(value) -> Callable[[Path], None]:
    return _config(lambda c: c["quantization_config"].__setitem__("weight_block_size", value))


def _raw_config(text: str) -> Callable[[Path], None]:
    return lambda ckpt: (ckpt / "config.json").write_text(text)


def _file_at(rel: str) -> Callable[[Path], None]:
    return lambda ckpt: (ckpt.parent / rel).write_text("mine")


def _nothing(_: Path) -> None:
    pass


# --------------------------------------------------------------------------- the table
# (case, command argv with {ckpt} and {tmp}, mutation of the copied checkpoint, text of the one line)
CASES = [
    # hangs: only regular files are opened
    ("inspect: shard is a FIFO", ["inspect", "{ckpt}"], _fifo(S6), f"{S6}: is a FIFO"),
    ("extract: shard is a FIFO", ["extract", "{ckpt}", "{tmp}/OUT"], _fifo(S6), f"{S6}: is a FIFO"),
    ("inspect: config.json is a FIFO", ["inspect", "{ckpt}"], _fifo("config.json"), "config.json: is a FIFO"),
    ("inspect: index is a FIFO", ["inspect", "{ckpt}"], _fifo(INDEX), f"{INDEX}: is a FIFO"),
    ("extract: shard is a folder", ["extract", "{ckpt}", "{tmp}/OUT"], _folder(S5), f"{S5}: is a folder"),
    # ambiguous JSON
    ("inspect: tensor twice in a header", ["inspect", "{ckpt}"], _duplicate_tensor,
     "duplicate key 'mtp.0.attn_norm.weight'"),
    ("extract: tensor twice in the index", ["extract", "{ckpt}", "{tmp}/OUT"], _duplicate_index_entry,
     "duplicate key 'mtp.0.attn_norm.weight'"),
    ("inspect: NaN in config.json", ["inspect", "{ckpt}", "--json"],
     _config(lambda c: c["text_config"].__setitem__("rope_theta", float("nan"))), "config.json: NaN"),
    ("inspect: config key twice", ["inspect", "{ckpt}"], _raw_config('{"vocab_size": 1, "vocab_size": 2}'),
     "config.json: duplicate key 'vocab_size'"),
    # quantization that would be silently replaced or mis-read
    ("inspect: weight_block_size [0, 32]", ["inspect", "{ckpt}"], _block([0, 32]), "weight_block_size [0, 32]"),
    ("extract: weight_block_size [true, 32]", ["extract", "{ckpt}", "{tmp}/OUT", "--dequantize", "bf16"],
     _block([True, 32]), "weight_block_size [True, 32]"),
    ("extract: weight_block_size [128]", ["extract", "{ckpt}", "{tmp}/OUT"], _block([128]), "weight_block_size [128]"),
    ("inspect: quantization_config a string", ["inspect", "{ckpt}"],
     _config(lambda c: c.__setitem__("quantization_config", "fp8")), "quantization_config is str"),
    ("extract: U8 scale", ["extract", "{ckpt}", "{tmp}/OUT", "--dequantize", "bf16"],
     _edit_entry("mtp.0.attn.wq_a.scale", dtype="U8"), "mtp.0.attn.wq_a.scale is U8"),
    ("extract: 3-D FP8 weight", ["extract", "{ckpt}", "{tmp}/OUT"],
     _edit_entry("mtp.0.attn.wq_a.weight", shape=[40, 2, 32]), "mtp.0.attn.wq_a.weight is 3-D"),
    ("extract: F32 scale of an FP4 weight", ["extract", "{ckpt}", "{tmp}/OUT"],
     _edit_entry("mtp.0.ffn.experts.0.w1.scale", dtype="F32", shape=[16, 1]), "mtp.0.ffn.experts.0.w1.scale is F32"),
    # options
    ("extract: --max-shard-size 0", ["extract", "{ckpt}", "{tmp}/OUT", "--max-shard-size", "0"], _nothing,
     "--max-shard-size '0'"),
    ("extract: --max-shard-size 0.4", ["extract", "{ckpt}", "{tmp}/OUT", "--max-shard-size", "0.4"], _nothing,
     "--max-shard-size '0.4'"),
    ("extract: --max-shard-size -1", ["extract", "{ckpt}", "{tmp}/OUT", "--max-shard-size", "-1"], _nothing,
     "--max-shard-size '-1'"),
    ("extract: --dequantize fp8", ["extract", "{ckpt}", "{tmp}/OUT", "--dequantize", "fp8"], _nothing,
     "--dequantize 'fp8'"),
    ("extract: OUT exists", ["extract", "{ckpt}", "{tmp}/mine"], _file_at("mine"), "already exists"),
    ("extract: OUT below a file", ["extract", "{ckpt}", "{tmp}/mine/OUT"], _file_at("mine"), "mine is not a folder"),
    # sources and hub ids
    ("inspect: empty source", ["inspect", ""], _nothing, "the source is empty"),
    ("extract: empty source", ["extract", "", "{tmp}/OUT"], _nothing, "the source is empty"),
    ("inspect: no such folder", ["inspect", "{tmp}/../../nope/x"], _nothing, "no such folder and not a repo id"),
    ("download: empty repo id", ["download", ""], _nothing, "'' is not a valid hub repo id"),
    ("download: ../../etc/passwd", ["download", "../../etc/passwd"], _nothing,
     "'../../etc/passwd' is not a valid hub repo id"),
    ("download: a/b/c", ["download", "a/b/c"], _nothing, "'a/b/c' is not a valid hub repo id"),
    ("download: org/na--me", ["download", "org/na--me"], _nothing, "'org/na--me' is not a valid hub repo id"),
    ("download: --local-dir is a file", ["download", "org/name", "--local-dir", "{tmp}/mine"], _file_at("mine"),
     "--local-dir"),
]


@pytest.mark.parametrize("case,argv,mutate,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, argv, mutate, needle, pristine: Path, tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in pristine.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    mutate(ckpt)
    before = snapshot(tmp_path)
    res = CliRunner().invoke(app, [a.format(ckpt=ckpt, tmp=tmp_path) for a in argv])
    message = res.stderr.strip()
    assert res.exit_code not in (0, None), f"{case}: exit 0\n{res.stdout}"
    assert len(message.splitlines()) == 1, f"{case}: not one line: {message!r}"
    assert message.startswith("error:") and "Traceback" not in res.output, message
    assert needle in message, f"{case}: {needle!r} not in {message!r}"
    assert snapshot(tmp_path) == before, f"{case}: files changed"


@pytest.mark.parametrize("mutate,check", [
    (_edit_entry("mtp.0.attn.wq_a.scale", dtype="U8"), "is U8"),
    (_edit_entry("mtp.0.attn.wq_a.weight", shape=[40, 2, 32]), "is 3-D"),
])
def test_inspect_calls_unusable_scales_an_error(mutate, check, pristine: Path, tmp_path: Path):
    """inspect used to call a U8 scale and a 3-D FP8 weight "ok"; the report is printed in full and
    the exit status (3) says it found something broken."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in pristine.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    mutate(ckpt)
    res = CliRunner().invoke(app, ["inspect", str(ckpt), "--json"])
    assert res.exit_code == 3 and res.stderr.startswith("error: 1 finding(s) at level error"), res.stderr
    scales = [f for f in json.loads(res.stdout)["findings"] if f["check"] == "scales"]
    assert scales[0]["level"] == "error" and check in scales[0]["message"]


def test_losing_one_of_two_simultaneous_extracts_says_so(pristine: Path, tmp_path: Path, monkeypatch):
    """Both runs checked that OUT did not exist; the other one renamed first."""
    out = tmp_path / "OUT"
    real = extract_mod._write_draft

    def other_run_finishes_first(*args, **kwargs):
        sha = real(*args, **kwargs)
        out.mkdir()
        (out / "theirs.safetensors").write_text("the winner's output")
        return sha

    monkeypatch.setattr(extract_mod, "_write_draft", other_run_finishes_first)
    res = CliRunner().invoke(app, ["extract", str(pristine), str(out)])
    message = res.stderr.strip()
    assert res.exit_code == 2 and len(message.splitlines()) == 1, message
    assert "was created by another process while this command ran" in message and "OSError" not in message
    assert sorted(p.name for p in out.iterdir()) == ["theirs.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT"]  # no partial of ours left


def test_extract_output_honours_the_umask(pristine: Path, tmp_path: Path):
    old = os.umask(0o027)
    try:
        res = CliRunner().invoke(app, ["extract", str(pristine), str(tmp_path / "OUT")])
    finally:
        os.umask(old)
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "OUT").stat().st_mode & 0o777 == 0o750
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "OUT").iterdir()} == {0o640}
    assert sorted(open_local(tmp_path / "OUT").weight_map) == sorted(open_local(pristine).draft_names())


def test_library_entries_name_fields_and_return_the_documents(pristine: Path, tmp_path: Path):
    """run_inspect, run_download, run_extract: a bad spec is refused in its fields' names (the CLI
    renders them as its flags), and a good one returns the document the command prints."""
    from dsparkctl.app.download import DownloadSpec, run_download
    from dsparkctl.app.extract import ExtractSpec, run_extract
    from dsparkctl.app.inspect import InspectSpec, run_inspect
    from dsparkctl.errors import DsparkError

    before = snapshot(pristine)
    cases = [
        (lambda: run_extract(ExtractSpec(str(pristine), pristine / "OUT")), "out_dir"),
        (lambda: run_extract(ExtractSpec(str(pristine), tmp_path / "X", dequantize="fp8")),
         "dequantize 'fp8' is not supported (fix: use dequantize bf16)"),
        (lambda: run_extract(ExtractSpec(str(pristine), tmp_path / "X", revision="main")),
         "revision applies to hub repos only (fix: drop revision for a local folder)"),
        (lambda: run_inspect(InspectSpec(str(pristine), "main")), "revision applies to hub repos only"),
        (lambda: run_download(DownloadSpec("org/name", local_dir=pristine)), f"local_dir {pristine} holds files"),
    ]
    for call, words in cases:
        with pytest.raises(DsparkError) as e:
            call()
        assert words in e.value.one_line() and "--" not in e.value.one_line(), e.value.one_line()
    assert snapshot(pristine) == before and not (tmp_path / "X").exists()
    assert run_inspect(InspectSpec(str(pristine)))["layout"]["key"] == "v4.1-flash"
    read: list[int] = []
    doc = run_extract(ExtractSpec(str(pristine), tmp_path / "X"), on_bytes=lambda n, total: read.append(total - n))
    res = CliRunner().invoke(app, ["extract", str(pristine), str(tmp_path / "Y"), "--json"])
    assert res.exit_code == 0, res.output
    cli = json.loads(res.stdout)
    assert {k: v for k, v in doc.items() if k != "out"} == {k: v for k, v in cli.items() if k != "out"}
    assert doc["out"] == str(tmp_path / "X") and read and min(read) >= 0
