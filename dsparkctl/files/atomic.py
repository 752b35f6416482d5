"""Atomic file output: write to a temporary sibling, fsync, rename. Nothing half-written.

Under torchrun every rank runs the same code and holds the same merged results, so the writers
here write on rank 0 alone (the other ranks run the writing block into os.devnull): they ask the
rank so that their callers need not. A file each rank writes for itself (its share of a data cache) says
`each_rank=True`."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from dsparkctl.distributed import world
from dsparkctl.errors import InputError
from dsparkctl.files import commit, journal, ledger
from dsparkctl.files.commit import WRITTEN
from dsparkctl.files.modes import current_umask, honour_umask, seal_dir  # noqa: F401 - their home for callers
from dsparkctl.files.ownership import NotOurs, replace_refusal
from dsparkctl.files.renames import crash_point, identify, keep_beside, replace_checked
from dsparkctl.signals import deferred
from dsparkctl.strict_json import finite


def cannot_create(path: str | os.PathLike) -> str | None:
    """Why `path` could not be created (its nearest existing parent is not a folder, or is not
    writable), or None."""
    parent = Path(path).absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"no permission to write in {parent}"
    return None


def cannot_write_file(path: str | os.PathLike) -> str | None:
    """Why a file could not be written (atomically replaced) at `path`: something other than a
    regular file already there (a folder, FIFO or link is not ours to replace), or `cannot_create`."""
    if os.path.lexists(path) and not (os.path.isfile(path) and not os.path.islink(path)):
        return f"{path} is not a regular file (a folder, FIFO or link there is not ours to replace)"
    return cannot_create(path)




def _writes(each_rank: bool = False) -> bool:
    """Whether this process writes the run's files: always outside torchrun, rank 0 under it."""
    if each_rank:
        return True

    return world().main


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", each_rank: bool = False,
                ours: Callable[[Path], bool] | None = None) -> Iterator[IO[Any]]:
    """Open a temporary file next to `path`; on success fsync and rename it over `path`.

    Inside a command's transaction (`files.commit.transaction`) the file is staged and appears
    with the command's other outputs at its commit point. On any exception the temporary file is
    removed and `path` is left untouched. Under torchrun only rank 0 writes, unless `each_rank`
    (see the module's docstring). The folder's ledger records the file as this command's.

    What is at `path` when the file is done is replaced only if this command wrote it (the
    ledger), or, for a cache, if `ours` recognises it as an entry; checked on the very file
    replaced (`files.renames`). Anything else there stays: `NotOurs` is raised, and this run's
    file is kept beside it (`NAME.dsparkctl-new-<run>`; a cache's is dropped).
    """
    if not _writes(each_rank):
        with open(os.devnull, mode) as fh:
            yield fh
        return
    tx = None if each_rank else commit.current()
    if tx is not None:
        target = Path(path) if tx.staged_name(path) else tx.file(path, ours=ours)
        with open(target, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        tx.sealed(target)
        return
    path = Path(os.path.abspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = _locked_temp(path)
    try:
        honour_umask(tmp)
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        crash_point("written")
        with deferred():  # in place, recorded and counted, or none of it
            _put(Path(tmp), path, ours)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _put(tmp: Path, path: Path, ours: Callable[[Path], bool] | None) -> None:
    """Rename the finished `tmp` to `path` under the folder's lock, replacing only what may be."""
    try:
        with ledger.folder_lock(path.parent):
            before = identify(path)
            why = replace_refusal(path, ours=ours)
            if not why and identify(path) != before:
                why = "changed while it was checked"
            if not why:
                ledger.record(path.parent, {path.name: (commit.command(), ledger.fingerprint(tmp))}, keep_old=True)
                if replace_checked(tmp, path, before, tmp.with_name(tmp.name + ".old")):
                    ledger.record(path.parent, {path.name: (commit.command(), ledger.fingerprint(path))},
                                  keep_old=False)
                    WRITTEN.append(path)
                    return
                why = "appeared while it was being replaced"
            if _same_bytes(path, tmp):  # already this very output (another rank's, say): nothing to replace
                os.unlink(tmp)
                return
            if ours is not None:  # a cache entry: what is there stays, this one is dropped
                raise NotOurs(f"{path} {why}; left as it is (this cache entry was not written)",
                              f"remove {path} yourself if it is no longer needed")
            kept = keep_beside(tmp, path, journal.RUN_ID)
    except FileNotFoundError as e:
        if os.path.lexists(tmp) and path.parent.is_dir():
            raise
        raise InputError(f"the folder {path.parent} was moved, removed or replaced while this command wrote "
                         f"{path.name}; this run's output is not in it", "run the command again") from e
    raise NotOurs(f"{path} {why}; found as this command put its output in place, it was left as it is, and this "
                  f"run's output was saved as {kept}",
                  f"keep the one you want under {path.name}: `mv {kept} {path}` keeps this run's")


def _same_bytes(path: Path, tmp: Path) -> bool:
    """Whether `path` is a regular file holding exactly the bytes of `tmp`."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode) and filecmp.cmp(path, tmp, shallow=False)
    except OSError:
        return False


try:
    import fcntl as _fcntl  # noqa: F401
    _LOCKS = True
except ImportError:  # pragma: no cover - not POSIX: no locks, and no stale-file cleanup
    _LOCKS = False


TEMP_MARK = ("user.dsparkctl", b"temp")  # set on every temp file this module makes


def _marked(fd: int) -> bool:
    try:
        return os.getxattr(fd, TEMP_MARK[0]) == TEMP_MARK[1]
    except (OSError, AttributeError):  # not marked, or no extended attributes here
        return False


def _locked_temp(path: Path) -> tuple[int, str]:
    """A new temp file beside `path`, created and then locked (held until it is renamed or removed:
    a temp file nobody locks is stale). Another writer's `remove_stale_temps` may take the file
    between its creation and the lock (two torchrun ranks writing one cache did): then it is locked
    by the sweeper or already unlinked, and a fresh one is made."""
    for _ in range(100):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with contextlib.suppress(OSError, AttributeError):  # unmarked: never swept (`remove_stale_temps`)
            os.setxattr(fd, *TEMP_MARK)
        locked = _lock(fd)
        try:
            if not locked and not _LOCKS:
                return fd, tmp
            if locked and os.fstat(fd).st_nlink > 0:
                return fd, tmp
        except OSError:
            pass
        os.close(fd)
    raise OSError(f"could not create a temporary file beside {path}: each was removed as it was made")


def _lock(fd: int) -> bool:
    """Take an exclusive, non-blocking lock on an open file; False when someone holds it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no locks, and no stale-file cleanup
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove temporary files of ours that a killed writer left beside `path`.

    Ours: named `.<name>.<8 mkstemp characters>.tmp`, a regular file owned by this user, marked by
    its writer (`TEMP_MARK`, an extended attribute set as it was created: a name alone is no proof;
    on a filesystem without them nothing is marked, and nothing removed).
    Stale: nobody holds its lock (every live writer locks its temp file; the kernel drops the lock
    when the writer dies, even by SIGKILL). Anything else is left alone."""
    import re

    name = re.escape(path.name)
    pattern = re.compile(rf"\.{name}\.[a-z0-9_]{{8}}\.tmp")
    removed = []
    try:
        candidates = [p for p in path.parent.iterdir() if pattern.fullmatch(p.name)]
    except OSError:
        return removed
    for p in candidates:
        try:
            st = p.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            if not _marked(fd):
                os.close(fd)
                continue
        except OSError:
            continue
        try:
            if _lock(fd):
                p.unlink()
                removed.append(p)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def write_json(path: str | os.PathLike, obj: Any, each_rank: bool = False,
               ours: Callable[[Path], bool] | None = None) -> None:
    """Atomically write `obj` as indented, strict JSON (non-finite floats become null); under
    torchrun on rank 0 alone unless `each_rank`; `ours` as for `atomic_open` (a cache's rule)."""

    with atomic_open(path, "w", each_rank=each_rank, ours=ours) as fh:
        json.dump(finite(obj), fh, indent=2, sort_keys=False, allow_nan=False)
        fh.write("\n")


@contextlib.contextmanager
def staged(folder_hint: str | os.PathLike | None = None) -> Iterator[Callable[[str | os.PathLike], Path]]:
    """Several outputs that appear together or not at all: `stage(final)` gives a hidden name
    beside `final` to write to (with the atomic writers above, or any writer); they appear at one
    commit point when the block ends without an error, and survive a kill at any moment as all
    old or all new (`files.commit`). Joins the command's transaction when one is open. Under
    torchrun on rank 0 alone (the writers above write nothing elsewhere)."""
    with commit.transaction() as tx:
        yield tx.file


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line to a log that grows as a run goes (not atomic: each line is whole on its
    own); under torchrun on rank 0 alone."""
    if _writes():
        with open(path, "a") as fh:
            fh.write(line + "\n")


def cut_log(path: str | os.PathLike, up_to: int, key: str = "step") -> None:
    """Before a resumed run appends again: keep only the lines of `path` (JSON lines, each with an
    integer `key`) at or before `up_to`, dropping those of steps the run will redo and a line torn
    by a kill. Rewritten atomically; nothing to do when there is no such file."""
    path = Path(path)
    if not _writes() or not path.is_file():
        return
    read = ledger.fingerprint(path)  # the log read is the log replaced: one swapped in meanwhile stays
    kept = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get(key), int) and row[key] <= up_to and line.endswith("\n"):
                kept.append(line)
    with atomic_open(path, "w", ours=lambda p: read is not None and ledger.fingerprint(p) == read) as fh:
        fh.writelines(kept)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, each_rank: bool = False, on_exists: str = "replace") -> Iterator[Path]:
    """Yield a hidden folder beside `path` to fill; it takes the name `path` when the block ends
    without an error (replacing a folder this command wrote there, `files.ledger`), or at the
    commit point of the command's transaction when one is open; on an error it is deleted. A kill
    leaves nothing the next run does not finish or remove (`files.commit.recover`). Under torchrun
    only rank 0 puts the folder in place (the others' is deleted), unless `each_rank`. With
    `on_exists` "refuse" a folder that appeared meanwhile is kept and this one discarded with an
    error; "keep", the same without one (a cache entry every run builds alike).
    """
    if not _writes(each_rank):
        tmp = Path(tempfile.mkdtemp(prefix=".dsparkctl-rank-"))
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    tx = None if each_rank else commit.current()
    if tx is not None:
        yield (staged := tx.folder(path, on_exists))
        tx.sealed(staged)  # written: the lock file names it by fingerprint from now on
        return
    with commit.transaction(join=False, each_rank=each_rank) as tx:
        yield (staged := tx.folder(path, on_exists))
        tx.sealed(staged)
