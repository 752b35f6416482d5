"""Corrupt or unsafe checkpoints: one-line error naming the file/tensor, exit != 0, no OUT folder."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from dsparkctl.checkpoint.fixtures import write_fixture
from dsparkctl.cli import console
from dsparkctl.cli.main import app

DRAFT_SHARD = "model-00005-of-00008.safetensors"  # mtp.0
SHARD6 = "model-00006-of-00008.safetensors"  # mtp.1


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _edit_header(file: str, fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        header, data = _split(folder / file)
        fn(header)
        _join(folder / file, header, data)
    return mutate


def _edit_index(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        path = folder / "model.safetensors.index.json"
        index = json.loads(path.read_text())
        fn(index["weight_map"])
        path.write_text(json.dumps(index))
    return mutate


def _drop_tensor(name: str, file: str = DRAFT_SHARD) -> Callable[[Path], None]:
    """Remove a tensor from its shard (re-laying the data) and from the index."""
    def mutate(folder: Path) -> None:
        header, data = _split(folder / file)
        meta = header.pop("__metadata__", None)
        del header[name]
        new, pos, out = {"__metadata__": meta} if meta else {}, 0, bytearray()
        for key, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            b, end = e["data_offsets"]
            new[key] = {**e, "data_offsets": [pos, pos + end - b]}
            out += data[b:end]
            pos += end - b
        _join(folder / file, new, bytes(out))
        _edit_index(lambda wm: wm.pop(name))(folder)
    return mutate


def _truncate(folder: Path) -> None:
    path = folder / DRAFT_SHARD
    path.write_bytes(path.read_bytes()[:-100])


def _header_past_eof(folder: Path) -> None:
    path = folder / DRAFT_SHARD
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(raw) + 10) + raw[8:])


def _not_json(folder: Path) -> None:
    path = folder / DRAFT_SHARD
    raw = bytearray(path.read_bytes())
    raw[8:20] = b"this is not"[:12].ljust(12, b"!")
    path.write_bytes(bytes(raw))


def _overlap(h: dict) -> None:
    h["mtp.0.ffn_norm.weight"]["data_offsets"] = list(h["mtp.0.attn_norm.weight"]["data_offsets"])


def _out_of_range(h: dict) -> None:
    b, e = h["mtp.0.attn_norm.weight"]["data_offsets"]
    h["mtp.0.attn_norm.weight"]["data_offsets"] = [b + 10**9, e + 10**9]


def _no_draft(folder: Path) -> None:
    for f in (DRAFT_SHARD, SHARD6, "model-00007-of-00008.safetensors"):
        (folder / f).unlink()
    _edit_index(lambda wm: [wm.pop(k) for k in [k for k in wm if k.startswith("mtp.")]])(folder)


def _nan_scale(folder: Path) -> None:
    header, data = _split(folder / DRAFT_SHARD)
    b, e = header["mtp.0.attn.wq_a.scale"]["data_offsets"]
    _join(folder / DRAFT_SHARD, header, data[:b] + b"\xff" * (e - b) + data[e:])


def _set(name: str, key: str, value) -> Callable[[dict], None]:
    return lambda h: h[name].__setitem__(key, value)


# (case id, mutation, what the one-line error must say: the file or tensor at fault and why, extra CLI args)
CASES = [
    ("truncated shard", _truncate, (DRAFT_SHARD, "out of range (data region is"), []),
    ("header length past EOF", _header_past_eof, (DRAFT_SHARD, "header length", "runs past the end of the file"), []),
    ("non-JSON header", _not_json, (DRAFT_SHARD, "header is not valid JSON"), []),
    ("overlapping offsets", _edit_header(DRAFT_SHARD, _overlap),
     (DRAFT_SHARD, "tensor mtp.0.ffn_norm.weight overlaps the previous tensor's bytes"), []),
    ("out-of-range offsets", _edit_header(DRAFT_SHARD, _out_of_range),
     ("tensor mtp.0.attn_norm.weight: data_offsets [1000031604, 1000031732] out of range",), []),
    ("unknown dtype", _edit_header(DRAFT_SHARD, _set("mtp.0.attn_norm.weight", "dtype", "F7_WAT")),
     ("tensor mtp.0.attn_norm.weight: unknown dtype 'F7_WAT'",), []),
    ("shape/bytes mismatch", _edit_header(DRAFT_SHARD, _set("mtp.0.attn_norm.weight", "shape", [63])),
     ("tensor mtp.0.attn_norm.weight: shape [63] × BF16 needs 126 bytes but spans 128",), []),
    ("index entry ../", _edit_index(lambda wm: wm.__setitem__("mtp.0.attn_norm.weight", "../x.safetensors")),
     ("tensor mtp.0.attn_norm.weight: shard '../x.safetensors' leaves the checkpoint folder",), []),
    ("index entry absolute", _edit_index(lambda wm: wm.__setitem__("mtp.0.attn_norm.weight", "/tmp/x.safetensors")),
     ("tensor mtp.0.attn_norm.weight: shard '/tmp/x.safetensors' leaves the checkpoint folder",), []),
    ("missing shard", lambda f: (f / SHARD6).unlink(), (f"{SHARD6}: shard file is missing",), []),
    ("missing scale", _drop_tensor("mtp.0.attn.wq_a.scale"),
     ("tensor mtp.0.attn.wq_a.weight (F8_E4M3) has no mtp.0.attn.wq_a.scale",), []),
    ("no draft tensors", _no_draft, ("no draft tensors",), []),
    ("index names a tensor the shard lacks", _edit_index(lambda wm: wm.__setitem__("mtp.9.x.weight", DRAFT_SHARD)),
     (f"index puts tensor mtp.9.x.weight in {DRAFT_SHARD} but its header lacks it",), []),
    ("NaN e8m0 scale on dequantize", _nan_scale, ("tensor mtp.0.attn.wq_a.weight: scale holds e8m0 NaN",),
     ["--dequantize", "bf16"]),
    ("config not JSON", lambda f: (f / "config.json").write_text("{oops"), ("config.json is not valid JSON",), []),
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_fixture(tmp_path_factory.mktemp("pristine") / "ckpt", "v4.1-flash")


@pytest.mark.parametrize("case,mutate,needles,args", CASES, ids=[c[0] for c in CASES])
def test_corrupt_input_is_refused(case, mutate, needles, args, pristine: Path, tmp_path: Path, monkeypatch):
    # The message is one line; the shared stderr console would hard-wrap it at 80 columns when not a TTY.
    monkeypatch.setattr(console.err, "soft_wrap", True)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in pristine.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    mutate(folder)
    out = tmp_path / "OUT"
    result = CliRunner().invoke(app, ["extract", str(folder), str(out), *args])
    message = result.stderr.strip()
    assert result.exit_code == 3, f"{case}: exit {result.exit_code}, not 3 (a corrupt or unsafe checkpoint)"
    assert len(message.splitlines()) == 1 and message.startswith("error: "), f"{case}: not one line: {message!r}"
    for needle in needles:
        assert needle in message, f"{case}: {needle!r} not in {message!r}"
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".OUT")], "temporary folder left behind"

