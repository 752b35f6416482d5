"""Scale-out through torch.distributed, launched by torchrun (NCCL on GPUs, gloo on CPU).

    torchrun --nproc-per-node N -m dsparkctl <train|eval-acceptance|generate> ...

Rank, world size and local rank come from the environment torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK); without them (a plain process) everything here is a no-op and world = 1. Each rank
uses its own GPU (cuda:LOCAL_RANK) or the CPU.

Work is split by units that do not depend on who runs them: prompt batches (each seeded from
(seed, batch index), engine/decode.py), teacher-forced sequences, data parts; `Split` is the one
wrapper that shares them out and merges the parts in their global order (the session's `split`
shares nothing when the ranks hold shards of one target). Every rank then holds the merged
result, and the writers are rank-aware (the atomic writers of files/atomic.py, the trace writer, print_json:
rank 0 alone writes and prints), so a merged run equals a one-process run and library code does
not ask which rank it is. Every rank parses the same command line; `check_same_everywhere` proves it by
comparing a digest of the arguments, so ranks can never run with different options.

A rank that fails prints its one-line error prefixed by its rank and exits non-zero; torchrun
then stops the other ranks (they unwind through their SIGTERM handler), so a job never hangs on
a collective that a dead peer will not join.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from dsparkctl.errors import UsageError

if TYPE_CHECKING:  # torch is imported where it is used: the file writers ask the rank without it
    import torch

T = TypeVar("T")
TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


_WORLD = World()


def world() -> World:
    return _WORLD


@dataclass(frozen=True)
class Split:
    """How a run's units of work (prompt batches, sequences, data parts) are shared among the
    ranks: round-robin, each rank its share and the parts merged after (data parallel); or, when
    the ranks hold shards of ONE model (`--target-parallel tp`, the session's `split`), not at all:
    every rank runs every unit together. In one process both are the whole work."""

    replicated: bool = False  # True: the ranks hold one model between them and run all units together

    @property
    def active(self) -> bool:
        """Whether units are divided among ranks at all (torchrun, not tensor parallel)."""
        return world().distributed and not self.replicated

    def mine(self, units: Sequence[T]) -> list[T]:
        """The units this rank runs (round-robin, so uneven work spreads evenly)."""
        w = world()
        return list(units)[w.rank::w.size] if self.active else list(units)

    def merged(self, part: T) -> list[T]:
        """Every rank's part, in rank order, on every rank (just this part when not divided)."""
        return all_gather(part) if self.active else [part]


DATA_PARALLEL = Split()  # the default: ranks divide the units


def env_world() -> World:
    """What torchrun's environment says (rank 0 of 1 without it)."""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise UsageError("RANK/WORLD_SIZE/LOCAL_RANK are not integers", "launch with torchrun") from None
    if size < 1 or not 0 <= rank < size:
        raise UsageError(f"RANK {rank} / WORLD_SIZE {size} are inconsistent", "launch with torchrun")
    return World(rank=rank, size=size, local_rank=local)


def init(device: str = "auto") -> World:
    """Join the process group when launched by torchrun; pick this rank's device. Idempotent."""
    global _WORLD
    w = env_world()
    if not w.distributed:
        _WORLD = w
        return w
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        use_cuda = device in ("auto", "cuda") and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(w.local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=TIMEOUT)
    _WORLD = w
    return w


def one_process(what: str) -> None:
    """Refuse to run `what`, a timing of ONE process (its numbers describe a machine running it
    alone), under torchrun: every rank would time it at once, contending for the same cores or
    memory bandwidth, and rank 0 would record the contended figure."""
    w = world() if world().distributed else env_world()
    if w.distributed:
        raise UsageError(f"{what} times one process, but this is rank {w.rank} of {w.size} (torchrun): every rank "
                         "would time it at once and the figures would be the contended ones",
                         "run it as a plain process, without torchrun (the table describes one process's steps)")


def rank_device(device: str) -> str:
    """`auto`/`cuda` become this rank's own GPU under torchrun; anything else is kept."""
    import torch

    w = world()
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{w.local_rank}" if w.distributed else "cuda"
    return device


FILE_DIGEST_LIMIT = 256 << 20  # files named on the command line up to this size are compared by content


def _arg_files(argv: Sequence[str]) -> list[tuple[str, str]]:
    """(argument, sha256 of the content) of every argument (or --opt=value value) naming a regular
    file: two ranks given `recipe.toml` in other folders, or one file that differs between hosts,
    must not run as if they agreed."""
    import stat

    out = []
    for a in argv:
        for cand in {a, a.split("=", 1)[1]} if a.startswith("--") and "=" in a else {a}:
            try:
                st = os.stat(cand)
            except (OSError, ValueError):
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size > FILE_DIGEST_LIMIT:
                continue
            h = hashlib.sha256()
            try:
                with open(cand, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
            except OSError:
                continue
            out.append((cand, h.hexdigest()))
    return out


def check_same_everywhere(argv: Sequence[str] | None = None) -> None:
    """Refuse to run when ranks were given different arguments, or files of one name that hold
    different contents (compares digests of both)."""
    w = world()
    if not w.distributed:
        return
    argv = list(argv if argv is not None else sys.argv[1:])
    args = hashlib.sha256("\0".join(argv).encode()).hexdigest()
    files = _arg_files(argv)
    mine = (args, hashlib.sha256(repr(files).encode()).hexdigest(), files)
    everyone = all_gather(mine)
    bad = [r for r, d in enumerate(everyone) if d[0] != everyone[0][0]]
    if bad:
        raise UsageError(f"ranks {bad} were started with other arguments than rank 0",
                         "launch every rank with the same command line (torchrun does)")
    bad = [r for r, d in enumerate(everyone) if d[1] != everyone[0][1]]
    if bad:
        theirs = dict(everyone[bad[0]][2])
        differ = [a for a, h in everyone[0][2] if theirs.get(a) != h] or [a for a in theirs if a not in dict(everyone[0][2])]
        raise UsageError(f"ranks {bad} read other contents than rank 0 from {', '.join(differ) or 'the files named'}",
                         "give every rank the same files (one shared path, or identical copies)")


def from_main(fn: Callable[[], T]) -> T:
    """`fn()` computed on rank 0 alone (outside torchrun: here), its result handed to every rank."""
    w = world()
    box = [fn() if w.main else None]
    if w.distributed:
        import torch.distributed as dist

        dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj: T) -> list[T]:
    w = world()
    if not w.distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * w.size
    dist.all_gather_object(out, obj)
    return out


def gather(obj: T) -> list[T] | None:
    """Every rank's object on rank 0 (in rank order); None on the other ranks."""
    w = world()
    if not w.distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] | None = [None] * w.size if w.main else None
    dist.gather_object(obj, out, dst=0)
    return out


def barrier() -> None:
    w = world()
    if w.distributed:
        import torch.distributed as dist
        dist.barrier()


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    """In place: the sum of `t` over ranks (no-op in one process)."""
    if world().distributed:
        import torch.distributed as dist
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def shutdown(barrier: bool = True) -> None:
    """Leave the process group in order: the ranks first meet at a barrier so none tears gloo down
    while a peer still talks to it (a rank that exited with the group alive could abort its peer at
    interpreter exit: "terminate called without an active exception"). The command's result is
    final by now, so a peer that vanished meanwhile (its own failure ends the job) is not an error
    here."""
    global _WORLD
    if world().distributed:
        import torch.distributed as dist
        if dist.is_initialized():
            try:
                if barrier:
                    dist.barrier()
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the peer's failure is reported by the peer
                pass
    _WORLD = World()
