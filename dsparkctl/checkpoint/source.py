"""A checkpoint as the tools see it: config, weight map and validated shard headers.

Built from a local folder here, or from a hub repo by `hub.open_remote`; both give the same
`Checkpoint`, so inspect/extract never care where the bytes live.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsparkctl.checkpoint.layouts import Layout, detect
from dsparkctl.checkpoint.safetensors_io import ShardHeader, TensorInfo, read_header, read_regular
from dsparkctl.errors import CheckpointError, InputError
from dsparkctl.strict_json import StrictJSONError, loads

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FP4_BLOCK = 32  # inputs sharing one FP4 e8m0 scale


@dataclass
class Checkpoint:
    source: str  # folder path or repo id, as the user gave it
    revision: str | None  # hub commit, or None for a local folder
    config: dict[str, Any]
    weight_map: dict[str, str]  # tensor name -> shard file
    headers: dict[str, ShardHeader]  # shard file -> header
    folder: Path | None = None  # local folder holding the shards
    total_size: int = 0  # sum of shard file sizes
    bytes_transferred: int = 0  # network bytes read to build this view (hub only)
    layout: Layout = field(init=False)

    def __post_init__(self) -> None:
        shapes = {n: self.tensor(n).shape for n, f in self.weight_map.items() if f in self.headers}
        self.layout = detect(self.weight_map, shapes, self.source)

    def tensor(self, name: str) -> TensorInfo:
        file = self.weight_map[name]
        if file not in self.headers:  # a draft-only download lacks the target's shards
            raise CheckpointError(f"{file}: shard file is missing (it holds tensor {name})",
                                  hint="download the missing shard (dsparkctl download fetches every draft shard)")
        return self.headers[file].tensors[name]

    def draft_names(self, with_head: bool = False) -> list[str]:
        """Draft tensors (and their scales); with_head adds the borrowed embedding/head."""
        names = [n for n in self.weight_map if self.layout.is_draft(n)]
        if with_head:
            names += [n for n in self.layout.head_names if n in self.weight_map]
        return names


def scale_name(weight: str) -> str:
    """`a.b.weight` -> `a.b.scale` (DeepSeek-V4's sibling, not V3's `weight_scale_inv`)."""
    return weight.removesuffix(".weight") + ".scale"


def quant_kind(info: TensorInfo) -> str | None:
    """'fp8' for F8_E4M3 weights, 'fp4' for I8 packed e2m1 weights, None for plain tensors."""
    if not info.name.endswith(".weight"):
        return None
    return {"F8_E4M3": "fp8", "I8": "fp4"}.get(info.dtype)


def check_shard_name(file: Any, where: str) -> str:
    """Reject index entries that are not a plain relative path inside the checkpoint folder."""
    if not isinstance(file, str) or not file:
        raise CheckpointError(f"{where}: shard name {file!r} is not a file name", hint="fix the index")
    norm = posixpath.normpath(file.replace("\\", "/"))
    if file.startswith(("/", "\\")) or (len(file) > 1 and file[1] == ":") or norm.startswith("..") \
            or norm != file.replace("\\", "/").removeprefix("./"):
        raise CheckpointError(f"{where}: shard {file!r} leaves the checkpoint folder",
                              hint="index entries must be plain relative names like model-00001-of-00048.safetensors")
    return norm


def parse_index(raw: bytes, where: str) -> dict[str, str]:
    """Weight map from `model.safetensors.index.json` bytes, every entry checked."""
    try:
        doc = loads(raw)
    except StrictJSONError as exc:  # e.g. one tensor mapped to two shards
        raise CheckpointError(f"{where}: ambiguous index: {exc}", hint="re-download the index") from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        doc = None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{where}: not a safetensors index (needs a 'weight_map' object)",
                              hint="re-download the index")
    return {str(name): check_shard_name(file, f"{where}: tensor {name}") for name, file in weight_map.items()}


def check_consistent(weight_map: dict[str, str], headers: dict[str, ShardHeader], where: str) -> None:
    """Every index entry is in its shard's header; every header tensor is in the index."""
    for name, file in weight_map.items():
        if file in headers and name not in headers[file].tensors:
            raise CheckpointError(f"{where}: index puts tensor {name} in {file} but its header lacks it",
                                  hint="re-download the index and that shard")
    for file, header in headers.items():
        for name in header.tensors:
            if weight_map.get(name) != file:
                raise CheckpointError(f"{file}: tensor {name} is not listed for this shard in the index",
                                      hint="re-download the index and that shard")


def check_scales(ckpt: Checkpoint, names: list[str]) -> None:
    """Every quantized weight among `names` has its `.scale` sibling."""
    for name in names:
        info = ckpt.tensor(name)
        if quant_kind(info) and scale_name(name) not in ckpt.weight_map:
            raise CheckpointError(f"{info.file}: tensor {name} ({info.dtype}) has no {scale_name(name)}",
                                  hint="the checkpoint is incomplete; re-download it")


def load_config(raw: bytes | None, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        cfg = loads(raw)
    except StrictJSONError as exc:
        raise CheckpointError(f"{where}: config.json: {exc}",
                              hint="fix config.json (strict JSON, each key once)") from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{where}: config.json is not valid JSON", hint="re-download config.json") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: config.json is not a JSON object", hint="re-download config.json")
    return cfg


def open_local(folder: Path) -> Checkpoint:
    """Read config, index and every shard header of a local checkpoint folder (no tensor data)."""
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder", hint="pass a checkpoint folder or a hub repo id")
    # Every file is opened only if it is a regular file (a FIFO would hang the reader).
    cfg_path = folder / "config.json"
    config = load_config(read_regular(cfg_path, "config.json") if cfg_path.exists() else None, str(folder))
    index = folder / INDEX
    if index.exists():
        weight_map = parse_index(read_regular(index, INDEX), str(index))
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE).exists():
        weight_map, files = {}, [SINGLE]
    else:
        raise CheckpointError(f"{folder}: no {INDEX} and no {SINGLE}", hint="point at a safetensors checkpoint")
    # Names were checked lexically (no '..', not absolute); shards may be symlinks into a hub cache.
    # Absent shards are allowed (draft-only downloads); using a tensor from one is an error.
    headers = {file: read_header(folder / file, file) for file in files if (folder / file).exists()}
    if not headers:
        raise CheckpointError(f"{folder}: none of the index's shards is present", hint="download the checkpoint")
    if not weight_map:
        weight_map = {n: SINGLE for n in headers[SINGLE].tensors}
    check_consistent(weight_map, headers, str(folder))
    total = sum(h.file_size for h in headers.values())
    return Checkpoint(source=str(folder), revision=None, config=config, weight_map=weight_map,
                      headers=headers, folder=folder, total_size=total)


def expected_scale_shape(kind: str, shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int] | None:
    """The `.scale` shape a weight of stored `shape` needs; None if the weight is not 2-D."""
    if len(shape) != 2:
        return None
    n, k = shape
    if kind == "fp8":
        return -(-n // block[0]), -(-k // block[1])
    return n, -(-(k * 2) // FP4_BLOCK)


def logical_shape(kind: str | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape after dequantization: FP4 packs two inputs per stored byte."""
    if kind == "fp4" and shape:
        return (*shape[:-1], shape[-1] * 2)
    return shape
