"""Partial outputs of `extract`: claim the one being built, remove stale ones left by killed runs.

`atomic_dir(OUT)` builds OUT in a hidden sibling `.OUT.<run>-<n>.new` (`files.commit`) and renames
it at the end. An interrupted run removes it (SIGINT, SIGTERM and SIGHUP all unwind); what SIGKILL,
a crash or a power cut leaves, the next run removes, on proof of death: the dead run's lock file
is free (`files.commit.recover`). The run also writes an owner file, `OWNER`, in its folder.

Folders of older versions (`.OUT.<8 random chars>.partial`) follow the older rule: one is removed
only when it is provably ours and provably stale:

  ours    a real folder (not a symlink) owned by this user and named exactly as atomic_dir named
          the partials of OUT; and
  stale   (a) it holds our owner file (tool dsparkctl, this OUT) and the file's lock is free.
              The kernel drops a flock when its holder dies, however it dies, so a lock we can
              take means no run owns the folder. Where the filesystem has no flock, the owner's
              pid recorded in the file must instead be gone on this host; or
          (b) it is empty and untouched for `STALE_EMPTY_S` seconds: a run killed between creating
              the folder and its owner file.
Anything else that looks like a partial of OUT is left alone and reported.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import time
from pathlib import Path
from typing import Iterator

from dsparkctl.files import commit
from dsparkctl.locks import pid_alive
from dsparkctl.strict_json import loads

OWNER = ".dsparkctl-owner"
STALE_EMPTY_S = 60.0
_NAME = "[a-z0-9_]{8}"  # tempfile.mkdtemp's random part


def partial_pattern(out: Path) -> re.Pattern[str]:
    """A partial of `out`: staged by `files.commit` (`.OUT.<run>-<n>.new`), or by an older version."""
    return re.compile(rf"\.{re.escape(out.name)}\.({_NAME}\.partial|[0-9a-f]{{12}}-[0-9]+\.new)")


def _legacy(out: Path) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(out.name)}\.{_NAME}\.partial")


@contextlib.contextmanager
def claim(tmp: Path, out: Path) -> Iterator[None]:
    """Own the partial folder `tmp` of `out` while the block runs (see module doc)."""
    owner = tmp / OWNER
    fd = os.open(owner, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        with contextlib.suppress(OSError):  # no flock on this filesystem: the pid rule applies
            fcntl.flock(fd, fcntl.LOCK_EX)  # before the content, so a sweeper never sees a claimed, unlocked file
        doc = {"tool": "dsparkctl", "command": "extract", "out": out.name, "pid": os.getpid(),
               "host": socket.gethostname(), "created": time.time()}
        os.write(fd, json.dumps(doc).encode())
        try:
            yield
        except BaseException:
            _empty_except(tmp, OWNER)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                owner.unlink()
    finally:
        os.close(fd)


def _empty_except(folder: Path, keep: str) -> None:
    for entry in os.scandir(folder):
        if entry.name == keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


def remove_stale(out: Path) -> list[str]:
    """Delete the stale partials of `out` (module doc); one note per partial found, removed or not."""
    parent = out.parent if str(out.parent) else Path(".")
    pattern = _legacy(out)
    mine = partial_pattern(out)
    notes = [n for n in commit.recover(parent) if mine.fullmatch(Path(n.split(": ", 1)[0].removeprefix("removed ")).name)]
    try:
        names = sorted(n for n in os.listdir(parent) if pattern.fullmatch(n))
    except OSError:  # no parent yet: nothing left behind
        return notes
    for name in names:
        path = parent / name
        reason = _stale_reason(path, out)
        notes.append(f"removed {path}: {reason[1]}" if reason[0] else f"left {path} alone: {reason[1]}")
    return notes


def _stale_reason(path: Path, out: Path) -> tuple[bool, str]:
    """(removed, why) for one candidate partial folder."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True, "already gone"
    if not stat.S_ISDIR(st.st_mode):
        return False, "not a folder"
    if st.st_uid != os.getuid():
        return False, "owned by another user"
    try:
        fd = os.open(path / OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return _remove_if_old_and_empty(path, st)
    except OSError:
        return False, "its owner file cannot be read"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False, "its owner file is not a regular file"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            locked = False
        except OSError:  # no flock here: fall back to the pid
            locked = None
        try:
            doc = loads(os.read(fd, 4096))
        except (OSError, ValueError, RecursionError):  # damaged (e.g. nested too deep): not ours
            doc = None
        if not (isinstance(doc, dict) and doc.get("tool") == "dsparkctl" and doc.get("out") == out.name):
            return False, "its owner file is not ours"
        pid = doc.get("pid")
        if locked is False:
            return False, f"a running extract (pid {pid}) is writing it"
        if locked is None and not (doc.get("host") == socket.gethostname() and isinstance(pid, int) and pid > 0
                                   and not pid_alive(pid)):
            return False, f"cannot tell whether pid {pid} on {doc.get('host')} still writes it"
        try:
            shutil.rmtree(path)  # never follows symlinks inside
        except OSError as exc:
            return False, f"could not remove it ({exc.strerror})"
        return True, f"stale partial of a run that died (pid {pid})"
    finally:
        os.close(fd)


def _remove_if_old_and_empty(path: Path, st: os.stat_result) -> tuple[bool, str]:
    try:
        empty = not os.listdir(path)
    except OSError:
        return False, "cannot list it"
    if not empty:
        return False, "no owner file (not written by this version); delete it yourself if no extract is running"
    if time.time() - st.st_mtime < STALE_EMPTY_S:
        return False, "empty but recent (a run may be starting)"
    try:
        os.rmdir(path)
    except OSError as exc:
        return False, f"could not remove it ({exc.strerror})"
    return True, "empty leftover of a killed run"

