"""Cut the draft out of a checkpoint into a standalone one, streaming.

Every output shard is created up front with its header, so each tensor has a known output
offset. Then one worker thread per source shard (up to 2 x cores) makes ONE front-to-back pass
over its shard: each 1 MiB chunk is read once (`os.preadv` into the worker's one reused buffer),
fed to the shard's sha256 (provenance; hashlib releases the GIL, so workers hash on all cores)
and, where it belongs to a kept tensor, written with `os.pwrite` at its output offset. Tensors
next to each other in the source and in the output form one segment. Meanwhile this thread
dequantizes the tensors to convert, reading weight + scale by byte range, one tensor at a time,
so peak memory is bounded by the largest tensor, not the shard.

Why not `os.copy_file_range` for the tensor bytes: every source byte must be read anyway for the
sha256, so an in-kernel copy is a second read of the same pages. Measured on ext4 (2 shared
cores, 1.39 GB, same run): read + hash + pwrite from the one buffer 0.51-0.67 s of system CPU,
read for the hash + copy_file_range 0.97-1.24 s. See docs/checkpoint.md.

Writeback of each output range is started as soon as it is written (on a flusher thread), so the
fsync of each output shard after the last byte has little left to wait for (atomic_dir's own
fsync pass then finds the files clean); the folder is fsynced before, and its parent after, the
rename. An interrupted or failed run leaves no OUT. SIGTERM and SIGHUP unwind like SIGINT (the
CLI turns them into KeyboardInterrupt); what SIGKILL leaves behind, the next run removes when it
is provably ours and provably stale (`partials`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dsparkctl.checkpoint import partials
from dsparkctl.checkpoint.inspect import consistency, stage_count
from dsparkctl.checkpoint.layouts import fp8_block
from dsparkctl.checkpoint.quant import dequant_fp4, dequant_fp8
from dsparkctl.checkpoint.safetensors_io import TensorInfo, read_header
from dsparkctl.checkpoint.shard_stream import Planned, ShardOutput, fsync_dir, open_source, stream_shard, worker_count
from dsparkctl.checkpoint.source import INDEX, Checkpoint, check_scales, logical_shape, quant_kind, scale_name
from dsparkctl.errors import CheckpointError, UsageError
from dsparkctl.files.atomic import atomic_dir, honour_umask, write_json
from dsparkctl.provenance import provenance
from dsparkctl.signals import point_of_no_return

CHUNK = 8 * 1024 * 1024  # read granularity of verify


@dataclass
class ExtractResult:
    out: Path
    tensors: int
    bytes_written: int
    shards: list[str]
    source_shards: dict[str, str] = field(default_factory=dict)  # file -> sha256
    verified: bool = False


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
                scale = ckpt.tensor(scale_name(info.name))
                items.append(Planned(info, "BF16", shape, 2 * math.prod(shape), kind, scale))
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
            on_bytes: Callable[[int], None] | None = None,
            log: Callable[[str], None] | None = None) -> ExtractResult:
    """Write the draft of `ckpt` (a local checkpoint) to `out` atomically.

    `on_bytes(n)` is told of every source byte read (summing to the source shards' sizes); it is
    called from the shard worker threads. `log` gets one line per partial folder of `out` that an
    earlier, killed run left behind (removed when provably stale, see `partials`).
    """
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
    for note in partials.remove_stale(out):
        (log or (lambda m: None))(note)
    with atomic_dir(out, on_exists="refuse") as tmp:  # a kill leaves nothing the next run does not remove
        with partials.claim(tmp, out):
            source_sha = _write_draft(ckpt, tmp, files, items, dequantize, with_head, verify, on_bytes)
        point_of_no_return()  # complete and fsynced: a signal now would only misreport the result
        for path in [tmp, *tmp.iterdir()]:  # temp files are private; the result is an ordinary folder
            honour_umask(path, directory=path.is_dir())
        fsync_dir(tmp)  # the folder's entries; atomic_dir fsyncs each file once more, then renames
    fsync_dir(out.parent)  # the rename itself
    return ExtractResult(out, len(items), sum(p.nbytes for p in items), files, source_sha, verify)


def _write_draft(ckpt: Checkpoint, tmp: Path, files: list[str], items: list[Planned], dequantize: bool,
                 with_head: bool, verify: bool, on_bytes: Callable[[int], None] | None) -> dict[str, str]:
    """Every output shard, the index and the config into `tmp`, fsynced; returns source sha256s."""
    block = fp8_block(ckpt.config, ckpt.layout)
    progress = on_bytes or (lambda n: None)
    by_file: dict[str, dict[str, Planned]] = {}
    for p in items:
        by_file.setdefault(p.src.file, {})[p.src.name] = p
    output = ShardOutput(tmp, files, items)
    cancel = threading.Event()
    fds: list[int] = []
    try:
        with ThreadPoolExecutor(worker_count(len(by_file)), thread_name_prefix="shard") as pool:
            try:
                jobs: dict[str, Future] = {}
                for file, wanted in by_file.items():
                    fds.append(open_source(ckpt, file))
                    jobs[file] = pool.submit(stream_shard, fds[-1], ckpt.headers[file], wanted, output,
                                             verify, progress, cancel)
                # meanwhile this thread converts the tensors to dequantize, one at a time
                for fd, wanted in zip(fds, by_file.values()):
                    for p in sorted(wanted.values(), key=lambda q: q.src.start):
                        if p.dequant:
                            data = _dequant(fd, p, block)
                            output.write(p, data)
                            if verify:
                                p.sha256 = hashlib.sha256(data).hexdigest()
                source_sha = {file: job.result() for file, job in jobs.items()}
            except BaseException:
                cancel.set()  # workers stop at their next chunk; the pool then joins them
                raise
        for fd in output.fds:  # while the folder is still claimed (see partials): a kill during the
            os.fsync(fd)  # long flush leaves a claimed folder that the next run removes
    finally:
        output.close()
        for fd in fds:
            os.close(fd)
    weight_map = {p.src.name: files[p.shard] for p in items}
    write_json(tmp / INDEX, {"metadata": {"total_size": sum(p.nbytes for p in items)}, "weight_map": weight_map})
    write_json(tmp / "config.json", _config(ckpt, items, dequantize, with_head, source_sha))
    if verify:
        _verify(tmp, files, items)
    return source_sha


def _dequant(fd: int, p: Planned, block: tuple[int, int]) -> memoryview:
    import torch  # only dequantization needs torch; plain extraction stays light

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
