"""A draft folder's files, read as hostile input: config.json (strict JSON), the safetensors index
and shards (our own header checks, the index consistent with the shards, each tensor once), nothing
outside the folder (a link out is refused), and never a pickle."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import Tensor

from dsparkctl.checkpoint.safetensors_io import read_header, read_regular
from dsparkctl.checkpoint.source import INDEX, SINGLE, check_consistent, parse_index
from dsparkctl.errors import CheckpointError, InputError
from dsparkctl.strict_json import loads as strict_loads


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files: the shards its index names (inside the folder), or the single file."""
    index = folder / INDEX
    if index.is_file():
        files = []
        for name in sorted(set(parse_index(read_regular(index, INDEX), str(index)).values())):
            f = folder / name
            try:
                inside(folder, f)  # a symlinked shard may still lead out
            except CheckpointError:
                raise CheckpointError(f"{index}: entry {name!r} points outside the checkpoint folder",
                                      "use a checkpoint whose index names only shards in its own folder") from None
            if not f.is_file():
                raise CheckpointError(f"{index}: shard {name} is missing or not a regular file",
                                      "re-download the checkpoint")
            files.append(f)
        return files
    if (folder / SINGLE).is_file():
        inside(folder, folder / SINGLE)
        return [folder / SINGLE]
    if os.path.lexists(folder / SINGLE):  # there, but a folder, a FIFO, a dangling link: never waited on or read
        raise CheckpointError(f"{folder / SINGLE}: is not a regular file", "replace it with the draft's weights file")
    raise CheckpointError(f"{folder}: no {SINGLE} or {INDEX}",
                          "a draft folder holds config.json and safetensors weights")


def inside(folder: Path, path: Path) -> None:
    """Refuse a file of the folder that is a link to somewhere else (a hub cache snapshot's links into
    its repo's blobs/ are where such files live)."""
    roots = [folder.resolve()]
    if roots[0].parent.name == "snapshots":
        roots.append(roots[0].parent.parent / "blobs")
    if not any(r in path.resolve().parents for r in roots):
        raise CheckpointError(f"{path} leads outside the draft folder ({path.resolve()})",
                              "copy the file into the folder instead of linking it")


def read_config_file(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointError(f"{folder}: no config.json", "a draft folder holds config.json and its weights")
    inside(folder, path)
    try:
        raw = strict_loads(read_regular(path, "config.json"))
    except (ValueError, UnicodeDecodeError) as exc:  # StrictJSONError is a ValueError
        raise CheckpointError(f"{path}: not valid JSON ({exc})", "fix or re-download config.json") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object", "config.json must be a JSON object of the draft's settings")
    return raw


def tensor_names(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from the safetensors headers only (no tensor data is read); the index, where
    there is one, must list exactly what each shard holds, and no tensor may be in two shards."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    headers = {f.name: read_header(f, f.name) for f in weight_files(folder)}
    if (folder / INDEX).is_file():
        check_consistent(parse_index(read_regular(folder / INDEX, INDEX), str(folder / INDEX)), headers,
                         str(folder / INDEX))
    for file, header in headers.items():
        for name, info in header.tensors.items():
            if name in out:
                raise CheckpointError(f"{folder}: tensor {name} is in two shards ({file} and another)",
                                      "re-download the checkpoint; a draft holds each tensor once")
            out[name] = (info.dtype, tuple(info.shape))
    return out


def read_tensors(folder: Path, checked: bool = False) -> dict[str, Tensor]:
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, Tensor] = {}
    if not checked:
        tensor_names(folder)  # our own strict header and index checks first
    for f in weight_files(folder):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    tensors[k] = fh.get_tensor(k)
        except PermissionError:
            raise InputError(f"{f} is not readable (permission denied)",
                             f"make it readable (chmod u+r {f}) or run as its owner") from None
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{f}: unreadable safetensors file ({str(exc).splitlines()[0]})",
                                  "re-download or re-convert the draft") from None
    return tensors
