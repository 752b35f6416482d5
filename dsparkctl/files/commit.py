"""One commit point per command, recovery on the next run: outputs survive SIGKILL the way a
database's rows do.

Terms:
  run       this process. Its id is a random nonce; in every folder it stages into it creates and
            `flock`s `.dsparkctl-run.<id>.lock` for as long as it lives. The kernel drops the lock
            when the process dies, however it dies, so a lock anyone can take is proof of death
            (a pid proves nothing: it is reused, and means nothing on another host).
  staged    an output written under a hidden name, `.<name>.<id>-<n>.new`, beside its final name.
  journal   `.dsparkctl-commit.<id>.json` in the first folder of a transaction: every (staged,
            final) pair as absolute paths (they do not depend on the current folder). Putting it in
            place (one rename) is the commit point: before it the transaction never happened;
            after it, it did, even if the process dies during the renames that follow.
  ledger    who wrote what (`files.ledger`, kept outside the folder); a replaced output is one the
            ledger says this command wrote, checked again at commit time under the folder's lock.

A commit holds the lock of every folder it touches (in a fixed order) while it records the new
fingerprints, writes the journal, renames (a folder being replaced steps aside to `.old` first)
and cleans up. `recover(folder)` (before anything is staged into a folder, and in every command's
output checks) takes the same lock and, for each run whose lock it can take, finishes the renames
if its journal exists (a final path a user filled since is left alone) or else removes its staged
files. So a run killed anywhere leaves, after the next run, every output old or every output new.

`transaction()` groups a command's outputs under one commit point; the writers in `files.atomic`
join the transaction that is open (`current()`), so a command wraps its body once and every file,
figure and folder it writes appears together or not at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from dsparkctl.errors import InputError
from dsparkctl.files import ledger
from dsparkctl.files.ledger import command, set_command  # noqa: F401 - the writer's identity, set by the CLI
from dsparkctl.files.modes import honour_umask, seal_dir
from dsparkctl.files.ownership import replace_refusal
from dsparkctl.signals import deferred
from dsparkctl.strict_json import loads

RUN_ID = secrets.token_hex(6)  # this process
_LOCK = ".dsparkctl-run.{}.lock"
_JOURNAL = ".dsparkctl-commit.{}.json"
_LOCK_RE = re.compile(r"\.dsparkctl-run\.([0-9a-f]{12})\.lock")
_STATE: dict[str, int] = {"n": 0}
_HELD: dict[Path, int] = {}  # folder -> fd of this run's lock file there
_OPEN: list["Transaction"] = []


WRITTEN: list[Path] = []  # every file or folder this process put in place, so an interruption can say so


def _abs(p: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.path.expanduser(p)))


def _hold(folder: Path, journal: Path | None = None) -> None:
    """Create and lock this run's lock file in `folder` (once per folder); it names the journal that
    decides the fate of what the run stages there."""
    if folder in _HELD:
        if journal is not None:
            _describe(folder, journal)
        return
    path = folder / _LOCK.format(RUN_ID)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a `recover` looks at it, a moment
        except OSError:
            break  # no flock on this filesystem: nothing here is ever provably dead
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)  # a `recover` took the file for a dead run's between our open and our lock: again
    _HELD[folder] = fd
    if journal is not None:
        _describe(folder, journal)


def _describe(folder: Path, journal: Path) -> None:
    fd = _HELD[folder]
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"tool": "dsparkctl", "journal": str(journal)}).encode(), 0)


def _release(folder: Path) -> None:
    fd = _HELD.pop(folder, None)
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(folder / _LOCK.format(RUN_ID))
    os.close(fd)


def _leftovers(folder: Path, run: str) -> list[Path]:
    pat = re.compile(rf"\..+\.{run}-\d+\.(new|old)|\.dsparkctl-commit\.{run}\.(tmp|json)", re.DOTALL)
    try:
        return [folder / n for n in os.listdir(folder) if pat.fullmatch(n)]
    except OSError:
        return []


def _remove(p: Path) -> None:
    with contextlib.suppress(OSError):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def recover(folder: str | os.PathLike) -> list[str]:
    """Finish or undo what dead runs left in `folder` (module doc); one note per run handled."""
    folder = _abs(folder)
    try:
        listing = os.listdir(folder)
    except OSError:
        return []
    names = [m[1] for n in listing if (m := _LOCK_RE.fullmatch(n)) and m[1] != RUN_ID]
    notes = []
    for run in names:
        lock = folder / _LOCK.format(run)
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # alive (or a filesystem without flock: then nothing is provably dead)
            try:
                doc = loads(os.read(fd, 65536) or b"{}")
            except (ValueError, RecursionError):
                doc = {}
            journal = Path(doc["journal"]) if isinstance(doc, dict) and isinstance(doc.get("journal"), str) else None
            if (journal is not None and journal.name == _JOURNAL.format(run) and journal.is_file()
                    and _roll_forward(journal, run)):
                notes.append(f"finished the commit of a run that died during it ({journal})")
            else:
                if journal is not None and journal.name == _JOURNAL.format(run):  # damaged: never a commit point
                    with contextlib.suppress(OSError):
                        journal.unlink()
                with ledger.folder_lock(folder):
                    for p in _leftovers(folder, run):
                        if p.name.endswith(".old"):  # only a committed run sets an old version aside
                            continue
                        _remove(p)
                        notes.append(f"removed {p}: a stale partial of a run that died before its commit")
            with contextlib.suppress(OSError):
                lock.unlink()
        finally:
            os.close(fd)
    return notes


@dataclass
class _Op:
    final: Path
    staged: Path
    folder: bool
    on_exists: str = "replace"  # a path that holds something at commit time: "replace" it if this command
    # wrote it (else refuse); "refuse" (an output that appeared meanwhile wins: an error); "keep" it and
    # discard this run's copy quietly (a cache entry any run builds alike)
    delete: bool = False  # an earlier output of this command that this run's set no longer holds

    @property
    def old(self) -> Path:
        return self.staged.with_name(self.staged.name[: -len(".new")] + ".old")


def _apply(ops: list[_Op], writer: str, replay: bool = False) -> None:
    """The renames of a committed transaction, idempotent (the journal may be replayed). A `replay`
    after a crash checks each final path again: what a user put there since is kept, and that op
    is undone instead (its staged copy removed)."""
    by_folder: dict[Path, dict[str, tuple[str, list | None]]] = {}
    for op in ops:
        if (replay and not op.delete and os.path.lexists(op.staged) and os.path.lexists(op.final)
                and ledger.writer_of(op.final) != writer):
            _remove(op.staged)  # not the version this command wrote there: the user's now
            continue
        if op.delete:
            if os.path.lexists(op.final) and ledger.writer_of(op.final) == writer:
                os.replace(op.final, op.old)  # removed below, with the old versions
        elif os.path.lexists(op.staged):
            if op.folder and os.path.lexists(op.final):
                os.replace(op.final, op.old)
            os.replace(op.staged, op.final)
        by_folder.setdefault(op.final.parent, {})[op.final.name] = (writer, ledger.fingerprint(op.final))
    for folder, changes in by_folder.items():
        ledger.record(folder, changes, keep_old=False)
    for op in ops:
        if os.path.lexists(op.old):
            _remove(op.old)


def _roll_forward(journal: Path, run: str) -> bool:
    """Finish a dead run's commit from its journal; False when the journal is not one (damaged: a
    commit point is a whole, fsynced file put in place by one rename, so this run never committed)."""
    try:
        if journal.lstat().st_uid != os.getuid():
            return False
        doc = loads(journal.read_text(encoding="utf-8"))
        ops = [_Op(Path(o["final"]), Path(o["staged"]), bool(o["folder"]), delete=bool(o.get("delete")))
               for o in doc["ops"]]
        writer = str(doc["command"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return False
    # only renames this run could have staged: a sibling named after its final path and this run
    ops = [op for op in ops if op.staged.parent == op.final.parent and op.final.is_absolute()
           and re.fullmatch(rf"\.{re.escape(op.final.name)}\.{run}-\d+\.new", op.staged.name, re.DOTALL)]
    folders = sorted({op.final.parent for op in ops} | {journal.parent})
    with contextlib.ExitStack() as stack:
        for f in folders:
            stack.enter_context(ledger.folder_lock(f))
        _apply(ops, writer, replay=True)
        with contextlib.suppress(OSError):
            journal.unlink()
        for f in folders:
            with contextlib.suppress(OSError):
                (f / _LOCK.format(run)).unlink()
    return True


@dataclass
class Transaction:
    """Outputs that appear together or not at all (module doc). `file(final)`/`folder(final)` give
    the hidden path to write; `commit()` puts them all in place."""
    writer: str
    private: Path | None = None  # torchrun's other ranks: outputs go here and are deleted
    ops: list[_Op] = field(default_factory=list)
    prunes: list[tuple[Path, re.Pattern[str]]] = field(default_factory=list)  # (folder, names), see `prune`
    made: list[Path] = field(default_factory=list)  # folders created for the outputs, removed on abort

    def _stage(self, final: str | os.PathLike, is_folder: bool, on_exists: str = "replace") -> Path:
        final = _abs(final)
        for op in self.ops:
            if op.final == final:
                return op.staged
        _STATE["n"] += 1
        if self.private is not None:
            staged = self.private / f"{_STATE['n']}-{final.name}"
            if is_folder:
                staged.mkdir()
            return staged
        missing = []
        parent = final.parent
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        final.parent.mkdir(parents=True, exist_ok=True)
        self.made.extend(reversed(missing))
        if final.parent not in _HELD:
            recover(final.parent)
        _hold(final.parent)
        staged = final.with_name(f".{final.name}.{RUN_ID}-{_STATE['n']}.new")
        if is_folder:
            staged.mkdir()
            honour_umask(staged, directory=True)
        self.ops.append(_Op(final, staged, is_folder, on_exists))
        return staged

    def file(self, final: str | os.PathLike) -> Path:
        return self._stage(final, False)

    def folder(self, final: str | os.PathLike, on_exists: str = "replace") -> Path:
        return self._stage(final, True, on_exists)

    def prune(self, folder: str | os.PathLike, pattern: str) -> None:
        """At the commit point, remove the files of `folder` whose names match `pattern` and that
        this command wrote, but this transaction does not write: an earlier run's set that the new
        one no longer holds (a figure of a position the new draft lacks). Decided under the folder's
        lock at commit time, so a run committing between our start and our commit is seen."""
        self.prunes.append((_abs(folder), re.compile(pattern, re.DOTALL)))

    def _pruned(self) -> list[_Op]:
        """The delete ops `prune` asked for, computed now (under the folders' locks)."""
        mine = {op.final for op in self.ops}
        ops = []
        for folder, pattern in self.prunes:
            with contextlib.suppress(OSError):
                for name in sorted(os.listdir(folder)):
                    final = folder / name
                    if pattern.fullmatch(name) and final not in mine and ledger.writer_of(final) == self.writer:
                        _STATE["n"] += 1
                        ops.append(_Op(final, final.with_name(f".{name}.{RUN_ID}-{_STATE['n']}.new"), False,
                                       delete=True))
        return ops

    def staged_name(self, path: str | os.PathLike) -> bool:
        p = _abs(path)
        return any(op.staged == p for op in self.ops)

    def commit(self) -> list[Path]:
        if not self.ops or self.private is not None:
            return []
        for op in [op for op in self.ops if os.path.lexists(op.staged)]:  # on disk before the commit point
            if op.folder:
                seal_dir(op.staged)
            else:
                with open(op.staged, "rb") as fh:
                    os.fsync(fh.fileno())
        ops = [op for op in self.ops if op.delete or os.path.lexists(op.staged)]
        first = ops[0].final.parent if ops else self.ops[0].final.parent
        journal = first / _JOURNAL.format(RUN_ID)
        folders = sorted({op.final.parent for op in ops} | {first})
        with contextlib.ExitStack() as stack:
            for f in folders:
                stack.enter_context(ledger.folder_lock(f))
            ops += [op for op in self._pruned() if op.final.parent in folders]
            for op in [op for op in ops if op.on_exists == "keep" and os.path.lexists(op.final)]:
                _remove(op.staged)  # another run built the same entry first: theirs stays
                ops.remove(op)
            for op in [op for op in ops if not op.delete]:  # again now: a user's file may have appeared since
                if op.on_exists == "refuse" and os.path.lexists(op.final):
                    raise InputError(f"{op.final} was created by another process while this command ran; this "
                                     "run's copy was discarded", "check that the other run's output is the one you want")
                why = replace_refusal(op.final, as_folder=op.folder)
                if why:
                    raise InputError(f"{op.final} {why}; refusing to replace it",
                                     "choose a new path, or remove it yourself (nothing was written)")
            with deferred():  # a signal here waits: the commit is a few renames
                for f in folders:
                    _hold(f, journal)
                by_folder: dict[Path, dict[str, tuple[str, list | None]]] = {}
                for op in ops:
                    by_folder.setdefault(op.final.parent, {})[op.final.name] = (self.writer,
                                                                                ledger.fingerprint(op.staged))
                for f, changes in by_folder.items():
                    ledger.record(f, changes, keep_old=True)
                doc = {"tool": "dsparkctl", "command": self.writer,
                       "ops": [{"final": str(o.final), "staged": str(o.staged), "folder": o.folder, "delete": o.delete}
                               for o in ops]}
                with open(journal.with_suffix(".tmp"), "w") as fh:
                    json.dump(doc, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(journal.with_suffix(".tmp"), journal)  # the commit point
                _apply(ops, self.writer)
                journal.unlink()
                WRITTEN.extend(op.final for op in ops)
        self.ops = []
        return [op.final for op in ops]

    def abort(self) -> None:
        for op in self.ops:
            _remove(op.staged)
        for d in reversed(self.made):
            _release(d)  # its lock file goes first, or the folder is not empty
            with contextlib.suppress(OSError):
                d.rmdir()
        self.ops = []


def current() -> Transaction | None:
    """The transaction the writers join, if a command opened one."""
    return _OPEN[-1] if _OPEN else None


@contextlib.contextmanager
def transaction(join: bool = True, each_rank: bool = False) -> Iterator[Transaction]:
    """Every output written inside appears when the block ends without an error, all at one
    commit point; on an error none does. A nested block joins the outer one, unless `join` is
    False (a cache entry that must appear now, inside a command that is still writing). Under
    torchrun the ranks other than 0 stage into a private folder that is deleted (unless
    `each_rank`: a file each rank writes for itself)."""
    if join and _OPEN:
        yield _OPEN[-1]
        return
    from dsparkctl.distributed import world

    tx = Transaction(command(), private=None if each_rank or world().main else Path(tempfile.mkdtemp(prefix=".dsparkctl-rank-")))
    if join:
        _OPEN.append(tx)
    try:
        yield tx
        tx.commit()
    except BaseException:
        tx.abort()
        raise
    finally:
        if tx in _OPEN:
            _OPEN.remove(tx)
        if tx.private is not None:
            shutil.rmtree(tx.private, ignore_errors=True)
        if not _OPEN:
            for f in list(_HELD):
                _release(f)
