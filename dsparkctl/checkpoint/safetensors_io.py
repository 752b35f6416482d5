"""Safe safetensors header parsing: 8-byte little-endian length, then a JSON header. Never unpickle.

Every check in docs/formats.md §5 lives here, so local and remote readers share one validator:
header length past the end of the file, non-JSON, unknown dtype, shape × dtype size != byte span,
offsets out of range, overlapping, or not covering the data region exactly, a tensor named twice
(duplicate JSON keys), NaN/Infinity constants. Local files are opened only when they are regular
files: a FIFO, device or socket named like a shard would block or stream forever.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsparkctl.errors import CheckpointError
from dsparkctl.strict_json import StrictJSONError, loads

# Bytes per stored element. FP4 e2m1 is stored as I8 (two codes per byte), so it is 1 here.
DTYPE_SIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors reference reader's own limit
_HINT = "re-download the shard (it is truncated or corrupt) or fix the file that produced it"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its shard header describes it."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file of the first data byte
    end: int  # absolute byte offset one past the last data byte
    file: str  # shard file name (relative to the checkpoint folder)

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ShardHeader:
    """A validated shard header: where each tensor's bytes are, and the file's size."""

    file: str
    header_len: int  # N in the 8-byte prefix
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)


def header_length(prefix: bytes, file: str, file_size: int) -> int:
    """Decode the 8-byte prefix and check the header fits in the file."""
    if file_size < 8 or len(prefix) < 8:
        raise CheckpointError(f"{file}: file is {file_size} bytes, shorter than the 8-byte header prefix",
                              hint=_HINT)
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{file}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit", hint=_HINT)
    if 8 + n > file_size:
        raise CheckpointError(f"{file}: header length {n} runs past the end of the file ({file_size} bytes)",
                              hint=_HINT)
    return n


def parse_header(raw: bytes, file: str, file_size: int) -> ShardHeader:
    """Validate the JSON header `raw` (without the 8-byte prefix) of a file of `file_size` bytes."""
    n = len(raw)
    data_len = file_size - 8 - n
    try:
        doc = loads(raw.decode("utf-8"))
    except StrictJSONError as exc:
        raise CheckpointError(f"{file}: header is ambiguous: {exc}", hint=_HINT) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: header is not valid JSON ({exc.__class__.__name__})", hint=_HINT) from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{file}: header is JSON but not an object", hint=_HINT)
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{file}: __metadata__ is not an object", hint=_HINT)

    tensors: dict[str, TensorInfo] = {}
    for name, entry in doc.items():
        tensors[name] = _tensor_entry(name, entry, file, data_len, 8 + n)

    # The data region must be tiled exactly: sorted spans, no overlap, no hole, nothing past the end.
    pos = 0
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        rel_start, rel_end = info.start - 8 - n, info.end - 8 - n
        if rel_start < pos:
            raise CheckpointError(f"{file}: tensor {info.name} overlaps the previous tensor's bytes "
                                  f"(offset {rel_start} < {pos})", hint=_HINT)
        if rel_start > pos:
            raise CheckpointError(f"{file}: {rel_start - pos} unaccounted bytes before tensor {info.name}",
                                  hint=_HINT)
        pos = rel_end
    if pos != data_len:
        raise CheckpointError(f"{file}: tensors cover {pos} data bytes but the file holds {data_len} "
                              f"after the header", hint=_HINT)
    return ShardHeader(file=file, header_len=n, file_size=file_size, tensors=tensors,
                       metadata={str(k): str(v) for k, v in metadata.items()})


def _tensor_entry(name: str, entry: Any, file: str, data_len: int, base: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{file}: tensor {name}: header entry is not an object", hint=_HINT)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZE:
        raise CheckpointError(f"{file}: tensor {name}: unknown dtype {dtype!r}", hint=_HINT)
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                            for d in shape)):
        raise CheckpointError(f"{file}: tensor {name}: shape {shape!r} is not a list of non-negative ints",
                              hint=_HINT)
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise CheckpointError(f"{file}: tensor {name}: data_offsets {offsets!r} is not [begin, end]", hint=_HINT)
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise CheckpointError(f"{file}: tensor {name}: data_offsets [{begin}, {end}] out of range "
                              f"(data region is {data_len} bytes)", hint=_HINT)
    expected = math.prod(shape) * DTYPE_SIZE[dtype]
    if end - begin != expected:
        raise CheckpointError(f"{file}: tensor {name}: shape {shape} × {dtype} needs {expected} bytes "
                              f"but spans {end - begin}", hint=_HINT)
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), start=base + begin, end=base + end, file=file)


def open_regular(path: Path, file: str) -> int:
    """A read-only fd of `path` (symlinks followed) if it is a regular file, else CheckpointError.

    Opened non-blocking, so a FIFO is refused instead of waiting for a writer; blocking mode is
    restored before returning. FileNotFoundError propagates (callers say what is missing).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:  # a socket (ENXIO), no permission, a loop of symlinks
        raise CheckpointError(f"{file}: cannot open ({exc.strerror})",
                              hint="check the file and its permissions") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a folder", stat.S_IFCHR: "a character device",
                stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}.get(stat.S_IFMT(mode), "not a file")
        raise CheckpointError(f"{file}: is {kind}, not a regular file", hint="replace it with the real file")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: Path, file: str) -> bytes:
    """All bytes of a small local file (config, index) that must be a regular file."""
    fd = open_regular(path, file)
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def read_header(path: Path, file: str | None = None) -> ShardHeader:
    """Read and validate the header of a local shard (reads only the header bytes)."""
    file = file or path.name
    try:
        fd = open_regular(path, file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: shard file is missing", hint="download the missing shard") from None
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fd).st_size
        n = header_length(fh.read(8), file, size)
        raw = fh.read(n)
    return parse_header(raw, file, size)


def encode_header(entries: list[tuple[str, str, tuple[int, ...], int]],
                  metadata: dict[str, str] | None = None) -> bytes:
    """Build `prefix + header` for tensors laid out back to back in the given order.

    `entries` are (name, dtype, shape, nbytes). The JSON is padded with spaces to a multiple of 8
    bytes, as the reference writer does, so tensor data stays aligned.
    """
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = metadata
    pos = 0
    for name, dtype, shape, nbytes in entries:
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw
