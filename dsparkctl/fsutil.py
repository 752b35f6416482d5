"""Atomic file output: write to a temporary sibling, fsync, rename. Nothing half-written.

Under torchrun every rank runs the same code and holds the same merged results, so the writers
here write on rank 0 alone (the other ranks run the writing block into os.devnull): library code
never asks which rank it is. A file each rank writes for itself (its share of a data cache) says
`each_rank=True`."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from dsparkctl.signals import deferred


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


def cache_root() -> Path:
    """The one folder of every cache dsparkctl keeps (the embedded target's conversion, training
    data and runs, kernel choices, step costs, continuations): `$DSPARKCTL_CACHE`, else
    `$XDG_CACHE_HOME/dsparkctl`, else ~/.cache/dsparkctl. An empty variable counts as unset
    (never the current folder)."""
    return env_path("DSPARKCTL_CACHE") or (env_path("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsparkctl"


def cache_path(name: str, override: str) -> Path:
    """One cache's place: `$<override>` when set, else `cache_root() / name`."""
    return env_path(override) or cache_root() / name


def env_path(name: str) -> Path | None:
    """The path an environment variable names, or None when it is unset or empty (or blank)."""
    value = os.environ.get(name, "")
    return Path(value).expanduser() if value.strip() else None


# ------------------------------------------------------------------ may we replace this path?
MARK = "dsparkctl"
# files we write in other tools' formats, which carry no marker of ours: recognised by their exact keys
FOREIGN_SCHEMAS = (frozenset({"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}),  # SGLang SPS
                   frozenset({"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}))  # SGLang STS
_SNIFF = 64 * 1024
_WHOLE_JSON = 64 * 1024 * 1024


def json_is_ours(obj: Any) -> bool:
    """A JSON document we wrote: an object whose `format` is one of ours ("dsparkctl-..."), or that
    carries our provenance (`provenance` / `dsparkctl` with tool "dsparkctl"), or a file of another
    tool's format that we write (FOREIGN_SCHEMAS, by its exact keys)."""
    if not isinstance(obj, dict):
        return False
    fmt = obj.get("format")
    if isinstance(fmt, str) and fmt.startswith(MARK + "-"):
        return True
    for key in ("provenance", MARK):
        block = obj.get(key)
        if isinstance(block, dict) and block.get("tool") == MARK:
            return True
    return frozenset(obj) in FOREIGN_SCHEMAS


def written_by_us(path: str | os.PathLike) -> bool:
    """Whether a regular file carries our own marker. JSON (and JSON lines): see `json_is_ours`,
    on the first line or the whole document; anything else (figures, scripts): the bytes
    "dsparkctl" in its first or last 64 KiB (PNG text chunk, PDF/SVG creator, script header)."""
    from dsparkctl.strict_json import loads

    try:
        size = os.stat(path).st_size
        with open(path, "rb") as fh:
            head = fh.read(_SNIFF)
            fh.seek(max(0, size - _SNIFF))
            tail = fh.read(_SNIFF)
            if head.lstrip()[:1] == b"{":
                first = head.split(b"\n", 1)[0]
                try:
                    if json_is_ours(loads(first.decode("utf-8"))):
                        return True
                except (ValueError, RecursionError):
                    pass
                if size > _WHOLE_JSON:
                    return False
                fh.seek(0)
                return json_is_ours(loads(fh.read().decode("utf-8")))
    except (OSError, ValueError, RecursionError):
        return False
    return MARK.encode() in head or MARK.encode() in tail


def replace_refusal(path: str | os.PathLike, ours: Callable[[Path], bool] | None = None) -> str | None:
    """The one rule for every file we write where a user may have put something: None (may write)
    when nothing is at `path`, or when it is a regular file (not a link) that we wrote (`ours`,
    default `written_by_us`); otherwise why not, as words to follow the path ("is a symbolic
    link", "was not written by dsparkctl", ...). Nothing is opened but a regular file."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (`cannot_create` says why it cannot be)
        return None
    except OSError as e:
        return f"cannot be examined ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "is a folder"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a FIFO, socket or device)"
    if not (ours or written_by_us)(Path(path)):
        return f"exists and was not written by {MARK}"
    return None


def regular_file(path: str | os.PathLike) -> bool:
    """True for a regular file (not a link to one, not a FIFO or device): the only thing a cache
    reader may open (a FIFO would block it, a device stream into it)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


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


def temp_dir(parent: str | os.PathLike, name: str, suffix: str = ".partial") -> Path:
    """A hidden temporary folder beside `parent/name`, with the umask's mode."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=suffix, dir=parent))
    honour_umask(tmp, directory=True)
    return tmp


WRITTEN: list[Path] = []  # every file or folder this process put in place, so an interruption can say so


def _writes(each_rank: bool = False) -> bool:
    """Whether this process writes the run's files: always outside torchrun, rank 0 under it."""
    if each_rank:
        return True
    from dsparkctl.distributed import world

    return world().main


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", each_rank: bool = False) -> Iterator[IO[Any]]:
    """Open a temporary file next to `path`; on success fsync and rename it over `path`.

    On any exception the temporary file is removed and `path` is left untouched. Under torchrun
    only rank 0 writes, unless `each_rank` (see the module's docstring).
    """
    if not _writes(each_rank):
        with open(os.devnull, mode) as fh:
            yield fh
        return
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
        with deferred():  # in place and counted as written, or neither
            os.replace(tmp, path)
            WRITTEN.append(path)
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


def write_json(path: str | os.PathLike, obj: Any, each_rank: bool = False) -> None:
    """Atomically write `obj` as indented, strict JSON (non-finite floats become null); under
    torchrun on rank 0 alone unless `each_rank`."""
    from dsparkctl.strict_json import finite

    with atomic_open(path, "w", each_rank=each_rank) as fh:
        json.dump(finite(obj), fh, indent=2, sort_keys=False, allow_nan=False)
        fh.write("\n")


FIGURE_MARK = {"png": {"Software": MARK}, "pdf": {"Creator": MARK}, "svg": {"Creator": MARK},
               "ps": {"Creator": MARK}, "eps": {"Creator": MARK}}


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120, as_path: str | os.PathLike | None = None) -> None:
    """Atomically save a matplotlib figure (format from the suffix), marked as ours where the
    format has a place for it. An existing file at `path` is replaced only if we wrote it
    (`replace_refusal`); `as_path` is the name the figure will finally have (when `path` is a
    staging name, see `staged`). Under torchrun on rank 0 alone."""
    from dsparkctl.errors import InputError

    if not _writes():
        return
    path = Path(path)
    final = Path(as_path) if as_path is not None else path
    why = replace_refusal(final)
    if why:
        raise InputError(f"{final} {why}; refusing to replace it", "choose a new path, or remove it yourself")
    fmt = final.suffix.lower().lstrip(".") or "png"
    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format=fmt, dpi=dpi, bbox_inches="tight", metadata=FIGURE_MARK.get(fmt))


@contextlib.contextmanager
def staged(folder_hint: str | os.PathLike | None = None) -> Iterator[Callable[[str | os.PathLike], Path]]:
    """Several outputs that appear together or not at all: `stage(final)` gives a hidden name
    beside `final` to write to (with the atomic writers above); when the block ends without an
    error every staged file is renamed onto its final name (renames in one folder need no space,
    so a full disk fails while writing, before any output appears), and folders created for
    them stay; on an error every staged file, and every folder created for them, is removed.
    Under torchrun on rank 0 alone (the writers above write nothing elsewhere)."""
    pairs: list[tuple[Path, Path]] = []
    made: list[Path] = []
    writes = _writes()

    def stage(final: str | os.PathLike) -> Path:
        final = Path(final)
        if not writes:
            return final.with_name(f".{final.name}.staged-{os.getpid()}")
        missing = []
        parent = final.parent
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        final.parent.mkdir(parents=True, exist_ok=True)
        made.extend(reversed(missing))
        tmp = final.with_name(f".{final.name}.staged-{os.getpid()}")
        pairs.append((tmp, final))
        return tmp

    try:
        yield stage
        with deferred():  # every output appears, or (a signal before this) none
            for tmp, final in pairs:
                os.replace(tmp, final)
                WRITTEN.append(final)
    except BaseException:
        for tmp, _ in pairs:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line to a log that grows as a run goes (not atomic: each line is whole on its
    own); under torchrun on rank 0 alone."""
    if _writes():
        with open(path, "a") as fh:
            fh.write(line + "\n")


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
def atomic_dir(path: str | os.PathLike, each_rank: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; rename it to `path` on success, delete on failure.

    `path` must not exist yet (callers decide about overwriting before calling). Under torchrun
    only rank 0 puts the folder in place (the others' is deleted), unless `each_rank`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(path.parent, path.name)
    try:
        yield tmp
        if not _writes(each_rank):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        seal_dir(tmp)
        with deferred():  # in place and counted as written, or neither
            os.replace(tmp, path)
            WRITTEN.append(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
