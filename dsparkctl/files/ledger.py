"""Whose file is this? What we recorded, never what it looks like.

Every folder we put an output in holds `.dsparkctl-owned.json`: for each name we put there, the
command that wrote it and the fingerprint of what it wrote — (device, inode, size, mtime) of a file;
for a folder, its own (device, inode) and the same four numbers of every entry inside. A path is
ours to replace only when the ledger of its folder names the command now writing and the path
still matches a recorded fingerprint. A user's file in a format we also write, a copy of one of
ours, our file edited or replaced by hand, a folder whose ledger was deleted: none match, so none
is replaced.

A rename keeps the inode, size and mtime, so a staged output's fingerprint is recorded *before*
it takes its final name (beside the fingerprint already there) and confirmed after: a kill at
any moment leaves the ledger naming whatever is at the path. Every change happens under an
exclusive `flock` of the folder itself (`folder_lock`), which is also what a commit holds while
it renames (`files.commit`), so a ledger update never interleaves with a live commit.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator

from dsparkctl.strict_json import loads

LEDGER = ".dsparkctl-owned.json"
FORMAT = "dsparkctl-ownership-1"
_MAX_LEDGER = 16 * 1024 * 1024
_MAX_ENTRIES = 100_000  # entries fingerprinted inside a folder output; beyond, the folder is not ours


def fingerprint(path: str | os.PathLike) -> list[Any] | None:
    """What a path is now, in numbers a rename keeps; None if nothing (or a link, a FIFO) is there."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISREG(st.st_mode):
        return ["file", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    if not stat.S_ISDIR(st.st_mode):
        return None
    inside = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files) + dirs:
            p = os.path.join(root, name)
            try:
                e = os.lstat(p)
            except OSError:
                return None
            inside.append([os.path.relpath(p, path), e.st_ino, e.st_size if stat.S_ISREG(e.st_mode) else -1,
                           e.st_mtime_ns if stat.S_ISREG(e.st_mode) else 0])
            if len(inside) > _MAX_ENTRIES:
                return None
    return ["folder", st.st_dev, st.st_ino, inside]


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on `folder` itself (blocking: every holder only renames and rewrites
    the ledger, a matter of milliseconds)."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        with contextlib.suppress(OSError):  # a filesystem without flock: no cross-process ordering
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read(folder: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The ledger's entries, {} when there is none or it is not ours (then nothing here is ours)."""
    p = Path(folder) / LEDGER
    try:
        st = os.lstat(p)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_LEDGER:
            return {}
        doc = loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError, UnicodeDecodeError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), dict):
        return {}
    return {k: v for k, v in doc["entries"].items()
            if isinstance(v, dict) and isinstance(v.get("command"), str) and isinstance(v.get("fp"), list)}


def _write(folder: Path, entries: dict[str, dict[str, Any]]) -> None:
    from dsparkctl.files.atomic import honour_umask

    fd, tmp = tempfile.mkstemp(prefix=f"{LEDGER}.", suffix=".tmp", dir=folder)
    try:
        honour_umask(tmp)
        with os.fdopen(fd, "w") as fh:
            json.dump({"format": FORMAT, "entries": entries}, fh, indent=1, allow_nan=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, folder / LEDGER)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def record(folder: Path, changes: dict[str, tuple[str, list[Any] | None]], *, keep_old: bool) -> None:
    """Under `folder_lock(folder)`: for each name, the command and the fingerprint it now has or is
    about to have. `keep_old`: add it beside those recorded (before a rename); otherwise it replaces
    them (after). Entries whose path matches none of its fingerprints any more are dropped."""
    entries = read(folder)
    for name, (command, fp) in changes.items():
        if fp is None:
            continue
        old = entries.get(name, {}).get("fp", []) if keep_old else []
        entries[name] = {"command": command, "fp": [f for f in old if f != fp] + [fp]}
    live = {}
    for name, e in entries.items():
        now = fingerprint(folder / name)
        if now is not None and (now in e["fp"] or name in changes):
            live[name] = {"command": e["command"], "fp": e["fp"] if name in changes else [now]}
    _write(folder, live)


def writer_of(path: str | os.PathLike) -> str | None:
    """The command that wrote what is at `path` now, per its folder's ledger; None when unrecorded."""
    path = Path(os.path.abspath(path))
    entry = read(path.parent).get(path.name)
    if entry is None:
        return None
    return entry["command"] if fingerprint(path) in entry["fp"] else None
