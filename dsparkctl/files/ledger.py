"""Whose file is this? What we recorded, never what it looks like.

For every folder we put an output in, a ledger records each name we put there: the command that
wrote it and the fingerprint of what it wrote — (device, inode, size, mtime) of a file; for a
folder, its own (device, inode) and the same numbers of every entry inside. A path is ours to
replace only when its folder's ledger names the command now writing and the path still matches a
recorded fingerprint. A user's file in a format we also write, a copy of one of ours, our file
edited or replaced by hand, a folder moved or restored from a backup: none match, so none is
replaced.

The ledgers live outside the folders they describe (`state_root()/owned/<hash of the folder>.json`),
so a user's folders hold only what they asked for. A ledger that cannot be written (a read-only
home) only means that what was written is not ours to replace later.

A rename keeps the inode, size and mtime, so a staged output's fingerprint is recorded *before*
it takes its final name (beside the fingerprint already there) and confirmed after: a kill at
any moment leaves the ledger naming whatever is at the path. Every change happens under an
exclusive `flock` of the folder itself (`folder_lock`), which is also what a commit holds while
it renames (`files.commit`), so a ledger update never interleaves with a live commit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator

from dsparkctl.files.cache import env_path
from dsparkctl.strict_json import loads

FORMAT = "dsparkctl-ownership-1"
_MAX_LEDGER = 16 * 1024 * 1024
_MAX_ENTRIES = 100_000  # entries fingerprinted inside a folder output; beyond, the folder is not ours


_WRITER: dict[str, str | None] = {"command": None}


def command() -> str:
    """The command whose outputs are being written (set by the CLI; "library" for Python callers)."""
    return _WRITER["command"] or "library"


def set_command(name: str | None) -> None:
    _WRITER["command"] = name


def state_root() -> Path:
    """Where dsparkctl keeps what it must remember between runs: `$DSPARKCTL_STATE`, else
    `$XDG_STATE_HOME/dsparkctl`, else ~/.local/state/dsparkctl."""
    return env_path("DSPARKCTL_STATE") or (env_path("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "dsparkctl"


def ledger_path(folder: str | os.PathLike) -> Path:
    """The ledger of `folder` (an absolute path)."""
    key = hashlib.sha256(os.fsencode(os.path.realpath(folder))).hexdigest()[:32]  # one folder, one ledger,
    # whatever symlinked path reaches it
    return state_root() / "owned" / f"{key}.json"


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


COMMIT_WAIT_S = 60.0  # a commit holds a folder for milliseconds: a minute means its holder is stopped


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, limit_s: float = COMMIT_WAIT_S) -> Iterator[None]:
    """Hold an exclusive lock on `folder` itself. Every holder only renames and rewrites a ledger, a
    matter of milliseconds, so a wait says so on stderr after a second and ends after `limit_s`
    (a holder stopped or hung) with an error naming the folder."""
    import sys
    import time

    from dsparkctl.errors import InputError

    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        t0, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - t0
                if waited >= limit_s:
                    raise InputError(f"another process has held the lock of {folder} for {waited:.0f} s (a dsparkctl "
                                     "commit takes milliseconds: that process is stopped or hung)",
                                     "let it finish, or end it (e.g. `fuser -v` on the folder), then run again") from None
                if not said and waited >= 1.0:
                    print(f"waiting for another process that is committing its outputs in {folder} "
                          f"(at most {limit_s:.0f} s)", file=sys.stderr, flush=True)
                    said = True
                time.sleep(0.05)
            except OSError:
                break  # a filesystem without flock: no cross-process ordering
        yield
    finally:
        os.close(fd)


_UNSAVED: dict[str, dict[str, dict[str, Any]]] = {}  # ledgers this process could not write: it still knows what
# it wrote (a second write of one output in one run, a checkpoint's latest.json), a later run does not


def read(folder: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The ledger's entries, {} when there is none or it is not ours (then nothing here is ours)."""
    p = ledger_path(folder)
    if str(p) in _UNSAVED:
        return {k: {"command": v["command"], "fp": list(v["fp"])} for k, v in _UNSAVED[str(p)].items()}
    try:
        st = os.lstat(p)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_LEDGER:
            return {}
        doc = loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError, UnicodeDecodeError):
        return {}
    if (not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("folder") != os.path.realpath(folder)
            or not isinstance(doc.get("entries"), dict)):
        return {}
    return {k: {"command": v["command"], "fp": [f for f in v["fp"] if isinstance(f, list)]}
            for k, v in doc["entries"].items()
            if isinstance(v, dict) and isinstance(v.get("command"), str) and isinstance(v.get("fp"), list)}


def sweep(folder: Path) -> None:
    """Under `folder_lock(folder)`: remove the temporary files of its ledger. Only a holder of the
    lock writes one, so any found now was left by a writer that died."""
    p = ledger_path(folder)
    with contextlib.suppress(OSError):
        for name in os.listdir(p.parent):
            if name.startswith(p.name + ".") and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(p.parent / name)


_WARNED: list[str] = []


def _cannot_remember(exc: OSError) -> None:
    """Say once per process that the ledger cannot be written (the outputs are written all the same)."""
    if not _WARNED:
        import sys

        _WARNED.append(str(state_root()))
        print(f"note: cannot record what this run writes in {state_root()} ({exc.strerror or exc}); a later run "
              "will refuse to replace these outputs (set DSPARKCTL_STATE to a folder you can write)",
              file=sys.stderr, flush=True)


def _write(folder: Path, entries: dict[str, dict[str, Any]]) -> None:
    p = ledger_path(folder)
    _UNSAVED[str(p)] = entries  # until it is on disk
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _cannot_remember(exc)  # nowhere to remember: what was written is not ours to replace later
    sweep(folder)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as exc:
        return _cannot_remember(exc)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"format": FORMAT, "folder": os.path.realpath(folder), "entries": entries}, fh,
                      allow_nan=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
        _UNSAVED.pop(str(p), None)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        _cannot_remember(exc)
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
        if name in changes and (changes[name][1] is not None or keep_old):  # even before it takes its name
            live[name] = e
        elif now is not None and now in e["fp"]:
            live[name] = {"command": e["command"], "fp": [now]}
    _write(folder, live)


def writer_of(path: str | os.PathLike) -> str | None:
    """The command that wrote what is at `path` now, per its folder's ledger; None when unrecorded."""
    path = Path(os.path.abspath(path))
    entry = read(path.parent).get(path.name)
    if entry is None:
        return None
    return entry["command"] if fingerprint(path) in entry["fp"] else None
