"""Atomic file output: write to a temporary sibling, fsync, rename. Nothing half-written."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike, directory: bool = False) -> None:
    """Give a temp file/folder (created 0600/0700) the mode a plain open/mkdir would have."""
    os.chmod(path, (0o777 if directory else 0o666) & ~current_umask())


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


def temp_dir(parent: str | os.PathLike, name: str, suffix: str = ".partial") -> Path:
    """A hidden temporary folder beside `parent/name`, with the umask's mode."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=suffix, dir=parent))
    honour_umask(tmp, directory=True)
    return tmp


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary file next to `path`; on success fsync and rename it over `path`.

    On any exception the temporary file is removed and `path` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        _lock(fd)  # held until the file is renamed or removed: a temp file nobody locks is stale
        honour_umask(tmp)
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


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

    Ours: named `.<name>.<8 mkstemp characters>.tmp`, a regular file owned by this user.
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
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
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


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write `obj` as indented, strict JSON (non-finite floats become null)."""
    from dsparkctl.strict_json import finite

    with atomic_open(path, "w") as fh:
        json.dump(finite(obj), fh, indent=2, sort_keys=False, allow_nan=False)
        fh.write("\n")


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> None:
    """Atomically save a matplotlib figure (format from the suffix)."""
    path = Path(path)
    fmt = path.suffix.lstrip(".") or "png"
    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format=fmt, dpi=dpi, bbox_inches="tight")


def seal_dir(folder: str | os.PathLike) -> None:
    """Before a written folder takes its final name: every entry gets the umask's mode (some
    writers, safetensors among them, create files 0600 whatever the umask) and every file is
    flushed to disk."""
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            honour_umask(os.path.join(root, name), directory=True)
        for name in files:
            honour_umask(os.path.join(root, name))
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; rename it to `path` on success, delete on failure.

    `path` must not exist yet (callers decide about overwriting before calling).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(path.parent, path.name)
    try:
        yield tmp
        seal_dir(tmp)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
