"""Cut the draft out of a checkpoint into a standalone one, streaming.

Each source shard that holds draft tensors is read once, front to back, in fixed-size chunks: the
bytes feed the shard's sha256 (for provenance) and the chunks that belong to draft tensors go
straight to the output. Tensors to dequantize are read by byte range (weight + scale) and
converted one at a time, so peak memory is bounded by the largest tensor, not the shard.
Everything is written into `atomic_dir(OUT)`: an interrupted or failed run leaves no OUT.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dsparkctl.checkpoint.inspect import consistency, stage_count
from dsparkctl.checkpoint.layouts import fp8_block
from dsparkctl.checkpoint.safetensors_io import TensorInfo, encode_header, read_header
from dsparkctl.checkpoint.source import INDEX, Checkpoint, check_scales, logical_shape, quant_kind, scale_name
from dsparkctl.errors import CheckpointError, UsageError
from dsparkctl.fsutil import atomic_dir, write_json
from dsparkctl.provenance import provenance

CHUNK = 8 * 1024 * 1024  # read/write granularity; bounds memory for plain copies


@dataclass
class Planned:
    """One output tensor and where it comes from."""

    src: TensorInfo
    dtype: str  # output dtype
    shape: tuple[int, ...]  # output shape
    nbytes: int
    dequant: str | None = None  # "fp8" | "fp4" when converted to bf16
    scale: TensorInfo | None = None  # the source scale consumed by dequantization
    sha256: str | None = None  # of the output bytes, filled in when verifying
    shard: int = 0  # output shard number (0-based)


@dataclass
class ExtractResult:
    out: Path
    tensors: int
    bytes_written: int
    shards: list[str]
    source_shards: dict[str, str] = field(default_factory=dict)  # file -> sha256
    verified: bool = False


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)[bB]?", text.strip())
    if not m:
        raise UsageError(f"--max-shard-size {text!r} is not a size", hint="use e.g. 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2).upper() or "_"))


def plan(ckpt: Checkpoint, with_head: bool, dequantize: bool, max_shard: int) -> list[Planned]:
    """Output tensors in source order (shard, then offset), assigned to output shards."""
    names = ckpt.draft_names(with_head)
    if not names:
        raise CheckpointError(f"{ckpt.source}: no draft tensors to extract", hint="check the layout with inspect")
    check_scales(ckpt, names)
    selected = set(names)
    consumed = {scale_name(n) for n in names if quant_kind(ckpt.tensor(n))} if dequantize else set()
    items: list[Planned] = []
    for file in sorted(ckpt.headers):
        for info in sorted(ckpt.headers[file].tensors.values(), key=lambda t: t.start):
            if info.name not in selected or info.name in consumed:
                continue
            kind = quant_kind(info) if dequantize else None
            if kind:
                shape = logical_shape(kind, info.shape)
                items.append(Planned(info, "BF16", shape, 2 * _numel(shape), kind, ckpt.tensor(scale_name(info.name))))
            else:
                items.append(Planned(info, info.dtype, info.shape, info.nbytes))
    shard, size = 0, 0
    for p in items:
        if size and size + p.nbytes > max_shard:
            shard, size = shard + 1, 0
        p.shard, size = shard, size + p.nbytes
    return items


def extract(ckpt: Checkpoint, out: Path, *, dequantize: bool = False, with_head: bool = False,
            max_shard_size: int = 5_000_000_000, verify: bool = False,
            on_bytes: Callable[[int], None] | None = None) -> ExtractResult:
    """Write the draft of `ckpt` (a local checkpoint) to `out` atomically."""
    if ckpt.folder is None:
        raise UsageError(f"{ckpt.source}: extract needs the shards on disk", hint="run `dsparkctl download` first")
    if out.exists():
        raise UsageError(f"{out} already exists", hint="choose a new output folder or delete the old one")
    errors = [f for f in consistency(ckpt) if f.level == "error"]
    if errors:
        raise CheckpointError(f"{ckpt.source}: {errors[0].message}", hint="fix config.json or the shards")
    items = plan(ckpt, with_head, dequantize, max_shard_size)
    n_out = items[-1].shard + 1
    files = [f"model-{i + 1:05d}-of-{n_out:05d}.safetensors" for i in range(n_out)]
    block = fp8_block(ckpt.config, ckpt.layout)
    progress = on_bytes or (lambda n: None)

    with atomic_dir(out) as tmp:
        writer = _Writer(tmp, files, items)
        source_sha: dict[str, str] = {}
        by_file: dict[str, dict[str, Planned]] = {}
        for p in items:
            by_file.setdefault(p.src.file, {})[p.src.name] = p
        for file, wanted in by_file.items():
            source_sha[file] = _stream_shard(ckpt, file, wanted, writer, block, verify, progress)
        writer.close()
        weight_map = {p.src.name: files[p.shard] for p in items}
        total = sum(p.nbytes for p in items)
        write_json(tmp / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        write_json(tmp / "config.json", _config(ckpt, items, dequantize, with_head, source_sha))
        if verify:
            _verify(tmp, files, items)
        for path in [tmp, *tmp.iterdir()]:  # temp files are private; the result is an ordinary folder
            path.chmod(0o755 if path.is_dir() else 0o644)
    return ExtractResult(out, len(items), total, files, source_sha, verify)


class _Writer:
    """Writes planned tensors, in plan order, rolling over to the next output shard as planned."""

    def __init__(self, folder: Path, files: list[str], items: list[Planned]):
        self.folder, self.files, self.items = folder, files, items
        self.current: int | None = None
        self.fh: Any = None

    def start(self, p: Planned) -> None:
        if p.shard != self.current:
            self.close()
            self.current = p.shard
            self.fh = open(self.folder / self.files[p.shard], "wb")
            entries = [(q.src.name, q.dtype, q.shape, q.nbytes) for q in self.items if q.shard == p.shard]
            self.fh.write(encode_header(entries, {"format": "pt"}))

    def write(self, data: Any) -> None:
        self.fh.write(data)

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


def _stream_shard(ckpt: Checkpoint, file: str, wanted: dict[str, Planned], writer: _Writer,
                  block: tuple[int, int], verify: bool, progress: Callable[[int], None]) -> str:
    """One front-to-back pass over a source shard; returns its sha256."""
    path = ckpt.folder / file  # type: ignore[operator]
    header = ckpt.headers[file]
    shard_sha = hashlib.sha256()
    # Hashing runs on a worker thread (hashlib releases the GIL) while this thread reads and
    # writes; two buffers alternate so a buffer is never refilled before its hash is done.
    bufs = [memoryview(bytearray(CHUNK)) for _ in range(2)]
    pending: list[Future | None] = [None, None]
    turn = 0
    with ThreadPoolExecutor(1) as hasher, open(path, "rb", buffering=0) as fh:
        if os.fstat(fh.fileno()).st_size != header.file_size:
            raise CheckpointError(f"{file}: shard changed size since its header was read", hint="rerun")
        shard_sha.update(_read_exact(fh, header.data_start, file))
        for info in sorted(header.tensors.values(), key=lambda t: t.start):
            p = wanted.get(info.name)
            copy = p is not None and p.dequant is None
            tensor_sha = hashlib.sha256() if (copy and verify) else None
            if copy:
                writer.start(p)  # type: ignore[arg-type]
            left = info.nbytes
            while left:
                slot, turn = turn % 2, turn + 1
                if pending[slot] is not None:
                    pending[slot].result()  # type: ignore[union-attr]
                buf = bufs[slot]
                n = fh.readinto(buf[:min(left, CHUNK)])
                if not n:
                    raise CheckpointError(f"{file}: truncated inside tensor {info.name}",
                                          hint="re-download the shard")
                chunk = buf[:n]
                pending[slot] = hasher.submit(shard_sha.update, chunk)
                if copy:
                    writer.write(chunk)
                    if tensor_sha:
                        tensor_sha.update(chunk)
                left -= n
                progress(n)
            if copy and tensor_sha:
                p.sha256 = tensor_sha.hexdigest()  # type: ignore[union-attr]
            if p is not None and p.dequant:
                data = _dequant(fh.fileno(), p, block)
                writer.start(p)
                writer.write(data)
                if verify:
                    p.sha256 = hashlib.sha256(data).hexdigest()
        for f in pending:
            if f is not None:
                f.result()
    return shard_sha.hexdigest()


def _dequant(fd: int, p: Planned, block: tuple[int, int]) -> memoryview:
    import torch  # only dequantization needs torch; plain extraction stays light

    from dsparkctl.checkpoint.quant import dequant_fp4, dequant_fp8

    weight = _load(fd, p.src)
    scale = _load(fd, p.scale)  # type: ignore[arg-type]
    if p.dequant == "fp8":
        out = dequant_fp8(weight, scale, block, p.src.name)
    else:
        out = dequant_fp4(weight, scale, p.src.name)
    return memoryview(out.contiguous().view(torch.uint8).numpy()).cast("B")


def _load(fd: int, info: TensorInfo) -> "torch.Tensor":  # noqa: F821
    import torch

    dtypes = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8}
    raw = os.pread(fd, info.nbytes, info.start)
    if len(raw) != info.nbytes:
        raise CheckpointError(f"{info.file}: truncated inside tensor {info.name}", hint="re-download the shard")
    return torch.frombuffer(bytearray(raw), dtype=dtypes[info.dtype]).view(info.shape)


def _read_exact(fh: Any, n: int, file: str) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise CheckpointError(f"{file}: truncated header", hint="re-download the shard")
    return data


def _verify(folder: Path, files: list[str], items: list[Planned]) -> None:
    """Re-read every output shard through the safe reader and check each tensor's sha256."""
    expected = {p.src.name: p for p in items}
    for file in files:
        header = read_header(folder / file, file)
        with open(folder / file, "rb") as fh:
            for info in header.tensors.values():
                p = expected[info.name]
                if (info.dtype, info.shape) != (p.dtype, p.shape):
                    raise CheckpointError(f"{file}: tensor {info.name} written as {info.dtype} {list(info.shape)}, "
                                          f"expected {p.dtype} {list(p.shape)}", hint="report this bug")
                fh.seek(info.start)
                h, left = hashlib.sha256(), info.nbytes
                while left:
                    chunk = fh.read(min(left, CHUNK))
                    h.update(chunk)
                    left -= len(chunk)
                if h.hexdigest() != p.sha256:
                    raise CheckpointError(f"{file}: tensor {info.name} does not match its source bytes",
                                          hint="the disk or the source changed during extraction; rerun")


def _config(ckpt: Checkpoint, items: list[Planned], dequantize: bool, with_head: bool,
            source_sha: dict[str, str]) -> dict[str, Any]:
    """The source config (the draft's fields live there) plus a draft summary and provenance."""
    cfg = json.loads(json.dumps(ckpt.config))
    if dequantize:
        cfg.pop("quantization_config", None)
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"].pop("quantization_config", None)
        cfg["torch_dtype"] = "bfloat16"
    cfg["dspark_draft"] = {
        "layout": ckpt.layout.key,
        "stages": stage_count(ckpt),
        "tensors": len(items),
        "with_head": with_head,
        "dequantized": "bf16" if dequantize else None,
    }
    cfg["provenance"] = provenance(source=ckpt.source, revision=ckpt.revision or _revision_from_path(ckpt.folder),
                                   source_shards_sha256=source_sha, command="extract")
    return cfg


def _revision_from_path(folder: Path | None) -> str | None:
    """A hub cache snapshot folder is named by its commit: .../snapshots/<sha>/."""
    if folder is not None and folder.resolve().parent.name == "snapshots":
        return folder.resolve().name
    return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
