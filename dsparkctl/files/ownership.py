"""May we replace this path? Only what this command wrote there, as its folder's ledger records
(`files.ledger`); never a link, a device, a folder where a file goes, or anything unrecorded. What
a file looks like (our marks, our format) is never a licence to replace an output; a cache, in a
folder a variable may point anywhere, replaces only an entry it recorded or whose own marks (its
format and key) it reads in it (`cache_entry`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable

from dsparkctl.errors import InputError
from dsparkctl.files import ledger

# ------------------------------------------------------------------ may we replace this path?
MARK = "dsparkctl"


def replace_refusal(path: str | os.PathLike, ours: Callable[[Path], bool] | None = None,
                   as_folder: bool = False) -> str | None:
    """The one rule for every output where a user may have put something: None (may write) when
    nothing is at `path`, or when it is a regular file (a folder, with `as_folder`), not a link,
    that this very command wrote there (`files.ledger`: what we recorded, never what it looks
    like; `ours` overrides the rule for a cache of our own); otherwise why not, as words to follow
    the path ("is a symbolic link", "was written by `dsparkctl train`, not by this command", ...)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (`cannot_create` says why it cannot be)
        return None
    except OSError as e:
        return f"cannot be examined ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if stat.S_ISDIR(st.st_mode) != as_folder:
        return "is a folder" if stat.S_ISDIR(st.st_mode) else "is not a folder"
    if not as_folder and not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a FIFO, socket or device)"
    if ours is not None:
        return None if ours(Path(path)) else f"exists and was not written by {MARK}"
    writer = ledger.writer_of(path)
    if writer is None:
        return f"exists and {MARK} has no record of writing it there"
    if writer != ledger.command():
        return f"was written by `{MARK} {writer}`, not by this command"
    return None


def inside_another_output(path: str | os.PathLike, as_folder: bool = False) -> str | None:
    """Why `path` may not be written because it is, or is directly inside, a folder another command
    wrote as its output (a draft export, an extract): writing there would change that output under
    its writer. None when it is not."""
    p = Path(os.path.realpath(os.path.dirname(os.path.abspath(path)))) / os.path.basename(os.path.abspath(path))
    for folder in ([p] if as_folder else []) + [p.parent]:
        entry = ledger.read(folder.parent).get(folder.name)
        if entry is not None and any(fp[:1] == ["folder"] for fp in entry["fp"]) and entry["command"] != ledger.command():
            return f"is {'' if folder == p else 'inside '}the output folder {folder} of `{MARK} {entry['command']}`"
    return None


def regular_file(path: str | os.PathLike) -> bool:
    """True for a regular file (not a link to one, not a FIFO or device): the only thing a cache
    reader may open (a FIFO would block it, a device stream into it)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


class NotOurs(InputError):
    """What is at an output's path is not ours to replace, found as the output was put in place; it
    was left as it is (the message says where this run's version went, if anywhere)."""


def recorded(path: str | os.PathLike) -> bool:
    """Whether what is at `path` is exactly what some dsparkctl command recorded writing there (any
    command: a cache is shared by all of them)."""
    entry = ledger.read(Path(os.path.abspath(path)).parent).get(Path(path).name)
    return entry is not None and ledger.fingerprint(path) in entry["fp"]


def cache_entry(marks: Callable[[bytes], bool], size: int = 4096) -> Callable[[Path], bool]:
    """A cache's rule for what it may replace: a regular file that dsparkctl recorded writing, or
    whose first `size` bytes carry the cache's own marks (`marks(head)`: its format and key, which a
    damaged entry of ours keeps and no file of the user's has). Anything else is someone's."""
    def ours(path: Path) -> bool:
        if not regular_file(path):
            return False
        if recorded(path):
            return True
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode) and marks(_head(fd, size))
        except OSError:
            return False
        finally:
            os.close(fd)
    return ours


def _head(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
