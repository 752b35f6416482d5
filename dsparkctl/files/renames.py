"""Renames that replace only what was checked, and never what appeared since the check.

"Is what is at `final` ours?" followed by a rename leaves a moment in which a user's file can take
the path and be overwritten. So:

  * a path that must still be free is taken with a rename that fails when anything is there
    (`renameat2(RENAME_NOREPLACE)` on Linux; elsewhere a hard link, which fails the same way, then
    the unlink of the staged name; a folder, which cannot be linked, is checked just before);
  * a path that holds our earlier version is swapped with the new one in one step
    (`renameat2(RENAME_EXCHANGE)`), and what came out is checked *after* the swap, on the very
    object that left: not what we checked, it is swapped straight back. Where the system cannot
    swap, a file is checked again just before `os.replace`, and a folder steps aside to a hidden
    name of ours, is checked there, and goes back if it is not ours.

At worst a user's file spends a moment under a hidden name and returns; it is never overwritten
nor deleted. Our version that cannot take its name is kept beside it (`keep_beside`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Callable

from dsparkctl.files.ledger import fingerprint

NOREPLACE, EXCHANGE = 1, 2
_AT_FDCWD = -100
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}
SYSCALL: dict[str, Any] = {"enabled": True, "fn": None, "looked": False}  # tests turn it off for the fallbacks


CRASH_HOOKS: list[Callable[[str], None]] = []  # empty in every real run


def crash_point(name: str) -> None:
    """A named step of a write or a commit: nothing happens here, unless a test hooked it to kill the
    process (does the next run finish or undo it?) or to put a user's file somewhere at that moment."""
    for hook in CRASH_HOOKS:
        hook(name)


def _renameat2() -> Any:
    if not SYSCALL["enabled"]:
        return None
    if not SYSCALL["looked"]:
        SYSCALL["looked"] = True
        with contextlib.suppress(OSError, AttributeError):
            fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28; absent elsewhere
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            SYSCALL["fn"] = fn
    return SYSCALL["fn"]


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(src, dst, flags); False where this system or file system cannot do it."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _exists_error(path: Path) -> FileExistsError:
    return FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))


def put_new(src: Path, dst: Path) -> None:
    """Give `src` the name `dst`, which must be free: FileExistsError when anything is there, even
    something that appeared a moment ago."""
    if _rename2(src, dst, NOREPLACE):
        return
    if os.path.isdir(src) and not os.path.islink(src):
        if os.path.lexists(dst):
            raise _exists_error(dst)
        os.rename(src, dst)  # no hard link for a folder: checked just before (a file or full folder still fails)
        return
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as e:  # a file system without hard links: checked just before
        if e.errno not in _UNSUPPORTED | {errno.EMLINK, errno.EXDEV}:
            raise
        if os.path.lexists(dst):
            raise _exists_error(dst) from None
        os.rename(src, dst)
        return
    os.unlink(src)  # a kill just before leaves two names of one file: the next run's recovery drops this one


def identify(path: str | os.PathLike) -> list | None:
    """`ledger.fingerprint`, or for a folder too large to fingerprint its identity (device, inode):
    what a commit compares before it renames."""
    fp = fingerprint(path)
    if fp is None and os.path.isdir(path) and not os.path.islink(path):
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            return ["ident", st.st_dev, st.st_ino]
    return fp


def folder_ident(path: str | os.PathLike) -> list | None:
    """[device, inode] of the folder at `path` (not a link to one); None when no folder is there."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            return [st.st_dev, st.st_ino]
    return None


def remove(path: Path) -> None:
    """Delete a file or folder of ours (errors ignored: it may be gone already)."""
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def within(now: list | None, recorded: list | None) -> bool:
    """Whether `now` is what `recorded` fingerprinted, or (a folder) a part of it: the same folder with
    some of its entries already deleted (a removal cut short), nothing added or changed."""
    if now is None or recorded is None:
        return False
    if now == recorded:
        return True
    if now[0] == "folder" == recorded[0] and now[1:3] == recorded[1:3]:
        have = {tuple(e) for e in recorded[3]}
        return all(tuple(e) in have for e in now[3])
    return False


def replace_checked(new: Path, final: Path, expect: list | None, aside: Path) -> bool:
    """Put `new` at `final` when nothing is there or exactly `expect` is (a fingerprint: what we
    checked and may replace; None: nothing may be). False, with both left as they are, when anything
    else is there. The replaced version goes (for a folder through `aside`, a hidden name of ours,
    so that a removal cut short leaves it under a name recovery knows)."""
    for _ in range(3):
        if not os.path.lexists(final):
            try:
                put_new(new, final)
                return True
            except FileExistsError:
                continue  # it appeared this very moment: judged like anything else that is there
        if expect is None or identify(final) != expect:
            return False
        crash_point("checked")
        if _rename2(new, final, EXCHANGE):
            crash_point("swapped")
            if identify(new) != expect:  # not the object we checked (it changed in between): back it goes
                _rename2(new, final, EXCHANGE)
                return False
            drop(new, aside)
            return True
        if not os.path.isdir(new):
            if identify(final) != expect:  # checked again just before: the window is this line
                return False
            os.replace(new, final)
            return True
        put_new(final, aside)
        crash_point("stepped-aside")
        if identify(aside) != expect:
            put_new(aside, final)  # not what we checked: back where it was
            return False
        try:
            put_new(new, final)
        except FileExistsError:  # something took the name in between: it stays, our old version goes
            remove(aside)
            return False
        remove(aside)
        return True
    return False


def drop(old: Path, aside: Path) -> None:
    """Delete our replaced version: a file at once, a folder after it takes the hidden name `aside`."""
    if os.path.isdir(old) and not os.path.islink(old):
        put_new(old, aside)
        remove(aside)
    else:
        os.unlink(old)


def take_away(path: Path, aside: Path, expect: list | None) -> bool:
    """Delete `path` when it is exactly `expect` (moved to `aside` first, checked there, and moved
    back if it is not); False, left in place, otherwise."""
    if expect is None or identify(path) != expect:
        return False
    put_new(path, aside)
    if identify(aside) != expect:
        put_new(aside, path)
        return False
    remove(aside)
    return True


def keep_beside(ours: Path, final: Path, run: str) -> Path:
    """Move `ours` (our version of `final`, where someone else's file now is) to a visible sibling
    named after both, never over anything; returns where it went."""
    for k in range(100):
        dst = final.with_name(f"{final.name}.dsparkctl-new-{run}" + (f"-{k}" if k else ""))
        try:
            put_new(ours, dst)
            return dst
        except FileExistsError:
            continue
    raise _exists_error(final.with_name(f"{final.name}.dsparkctl-new-{run}"))
