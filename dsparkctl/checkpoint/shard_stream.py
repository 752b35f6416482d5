"""The streaming copy behind `extract`: one worker per source shard reads it front to back once,
hashes every byte and writes the kept tensors at their output offsets (checkpoint/extract.py
explains the design and its measurements); writeback of written ranges starts at once."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.checkpoint.safetensors_io import ShardHeader, TensorInfo, encode_header, open_regular
from dsparkctl.checkpoint.source import Checkpoint
from dsparkctl.errors import CheckpointError

STREAM_CHUNK = 1024 * 1024  # a shard worker's read size (its one buffer; bounds memory for plain copies)


WRITEBACK_STEP = 64 * 1024 * 1024  # start writeback of the output every this many bytes of a segment


def worker_count(shards: int) -> int:
    """One worker per source shard, up to twice the cores: a shard's sha256 is sequential, so with
    fewer workers than shards the last shard runs alone while other cores idle (3 equal shards on
    2 workers take 2/3 of the total; on 3 they take 1/2 of it on 2 cores)."""
    return max(1, min(shards, 2 * (os.cpu_count() or 1)))


class ShardOutput:
    """Every output shard, created up front with its header; each tensor has a planned offset.

    Tensors are written with os.pwrite at their offsets, so shard workers write in parallel and
    in any order. Files are fsynced after the last byte (`_write_draft`). Writeback is started
    early (`kick`) so that fsync has little left to wait for.
    """

    def __init__(self, folder: Path, files: list[str], items: list[Planned]):
        self.fds: list[int] = []
        self.place: dict[str, tuple[int, int]] = {}  # tensor name -> (fd, offset)
        self.flusher = ThreadPoolExecutor(1, thread_name_prefix="writeback")
        by_shard: dict[int, list[Planned]] = {}
        for p in items:
            by_shard.setdefault(p.shard, []).append(p)
        try:
            for shard, file in enumerate(files):
                fd = os.open(folder / file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                self.fds.append(fd)
                entries = [(q.src.name, q.dtype, q.shape, q.nbytes) for q in by_shard.get(shard, [])]
                head = encode_header(entries, {"format": "pt"})
                pos = self.pwrite(fd, head, 0)
                for q in by_shard.get(shard, []):
                    self.place[q.src.name] = (fd, pos)
                    pos += q.nbytes
        except BaseException:
            self.close()
            raise

    @staticmethod
    def pwrite(fd: int, data: Any, offset: int) -> int:
        """Write all of `data` at `offset`; returns the offset after it."""
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
        return offset

    def write(self, p: Planned, data: Any) -> None:
        fd, offset = self.place[p.src.name]
        self.pwrite(fd, data, offset)
        self.kick(fd, offset, p.nbytes)

    def kick(self, fd: int, offset: int, n: int) -> None:
        """Start (not wait for) writeback of a written range, on the flusher thread.

        On Linux, POSIX_FADV_DONTNEED first starts asynchronous writeback of the range's dirty
        pages (then drops only pages already clean), so the disk writes while the workers go on:
        same bytes, same final fsync, only earlier. The call can block while the device queue is
        full, hence its own thread. It is advice: errors are ignored; a no-op without posix_fadvise.
        """
        if n and hasattr(os, "posix_fadvise"):
            self.flusher.submit(_advise_written, fd, offset, n)

    def close(self) -> None:
        self.flusher.shutdown(wait=True)  # before the fds it uses are closed
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _advise_written(fd: int, offset: int, n: int) -> None:
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)  # type: ignore[attr-defined]


@dataclass
class _Segment:
    """Bytes [start, end) of a source shard that go, unchanged, to `fd` at `out`."""

    start: int
    end: int
    fd: int
    out: int


def open_source(ckpt: Checkpoint, file: str) -> int:
    try:
        fd = open_regular(ckpt.folder / file, file)  # type: ignore[operator]
    except FileNotFoundError:
        raise CheckpointError(f"{file}: shard vanished since its header was read", hint="rerun") from None
    if os.fstat(fd).st_size != ckpt.headers[file].file_size:
        os.close(fd)
        raise CheckpointError(f"{file}: shard changed size since its header was read", hint="rerun")
    return fd


def stream_shard(fd: int, header: ShardHeader, wanted: dict[str, Planned], output: ShardOutput, verify: bool,
                  progress: Callable[[int], None], cancel: threading.Event) -> str:
    """One front-to-back pass over a source shard (on a worker thread); returns its sha256.

    Each chunk is read once into a reused buffer, fed to the shard's sha256 (and, with `verify`,
    to the tensor's), and, where it belongs to a copied tensor, written at its output offset.
    Tensors next to each other in the source and in the output form one segment.
    """
    segments: list[_Segment] = []
    for p in sorted((q for q in wanted.values() if not q.dequant), key=lambda q: q.src.start):
        out_fd, out = output.place[p.src.name]
        last = segments[-1] if segments else None
        if last and last.end == p.src.start and last.fd == out_fd and last.out + last.end - last.start == out:
            last.end = p.src.end
        elif p.src.nbytes:
            segments.append(_Segment(p.src.start, p.src.end, out_fd, out))
    tensors: dict[int, Planned] = {}  # start -> copied tensor whose source bytes to hash (verify)
    for p in wanted.values():
        if verify and not p.dequant:
            if p.src.nbytes:
                tensors[p.src.start] = p
            else:
                p.sha256 = hashlib.sha256().hexdigest()
    starts = {s.start: s for s in segments}
    marks = sorted({0, header.file_size, *starts, *(s.end for s in segments),
                    *tensors, *(p.src.end for p in tensors.values())})
    shard_sha, buf = hashlib.sha256(), memoryview(bytearray(STREAM_CHUNK))
    seg: _Segment | None = None
    kicked = 0
    for start, end in zip(marks, marks[1:]):
        if start in starts:
            seg, kicked = starts[start], start
        elif seg and start >= seg.end:
            seg = None
        tensor_sha = hashlib.sha256() if start in tensors else None
        pos = start
        while pos < end:
            if cancel.is_set():
                return ""
            n = os.preadv(fd, [buf[:min(STREAM_CHUNK, end - pos)]], pos)
            if not n:
                raise CheckpointError(f"{header.file}: truncated at byte {pos} of {header.file_size}",
                                      hint="re-download the shard")
            chunk = buf[:n]
            shard_sha.update(chunk)
            if tensor_sha:
                tensor_sha.update(chunk)
            pos += n
            if seg:
                output.pwrite(seg.fd, chunk, seg.out + pos - n - seg.start)
                if pos - kicked >= WRITEBACK_STEP or pos == seg.end:
                    output.kick(seg.fd, seg.out + kicked - seg.start, pos - kicked)
                    kicked = pos
            progress(n)
        if tensor_sha:
            tensors[start].sha256 = tensor_sha.hexdigest()
    return shard_sha.hexdigest()


def fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a folder; best effort
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
