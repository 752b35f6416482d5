"""OS errors in words a user can act on: a full disk, a read-only file system, a missing permission."""

from __future__ import annotations

import errno
import os
import shutil

# ------------------------------------------------------------------ OS errors in words
_ENV_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
               errno.EDQUOT: "the disk quota is exhausted", errno.EACCES: "permission denied",
               errno.EPERM: "operation not permitted", errno.EFBIG: "the file is too large for the file system",
               errno.ENAMETOOLONG: "a file name is too long", errno.EMFILE: "too many open files",
               errno.ENOTDIR: "a part of the path is not a folder", errno.EISDIR: "it is a folder",
               errno.ENOENT: "no such file or folder", errno.EEXIST: "it already exists"}


def os_error_words(exc: BaseException) -> tuple[str, int] | None:
    """(one line, errno) for an OSError, or for another library's exception that wraps one in its
    message (safetensors, torch.save: "No space left on device"); None otherwise."""
    if isinstance(exc, OSError) and exc.errno in _ENV_ERRNOS:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{_ENV_ERRNOS[exc.errno]}{where}", exc.errno
    text = str(exc)
    for num, words in _ENV_ERRNOS.items():
        if num in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG) and os.strerror(num) in text:
            return words, num
    cause = exc.__cause__ or exc.__context__
    return os_error_words(cause) if cause is not None and cause is not exc else None


def full_disk_error(exc: BaseException, folder: str | os.PathLike, margin: int = 16 << 20) -> OSError | None:
    """An OSError(ENOSPC) for a writer's opaque failure (torch.save: "unexpected pos ...") when the
    file system of `folder` is (nearly) full, so it is said as a full disk; else None."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if free >= margin:
        return None
    err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
    err.__cause__ = exc
    return err
