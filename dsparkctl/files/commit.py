"""One commit point per command, recovery on the next run: outputs survive SIGKILL the way a
database's rows do, and nothing this tool did not write is ever replaced.

Terms:
  run       this process. Its id is a random nonce; in every folder it stages into it creates and
            `flock`s `.dsparkctl-run.<id>.lock` for as long as it lives. The kernel drops the lock
            when the process dies, however it dies, so a lock anyone can take is proof of death
            (a pid proves nothing: it is reused, and means nothing on another host). The lock file
            says what the run staged there (by identity, then by fingerprint once written) and,
            from its commit on, which journal decides their fate.
  staged    an output written under a hidden name, `.<name>.<id>-<n>.new`, beside its final name.
  journal   `.dsparkctl-commit.<id>.json` in the first folder of a transaction: every operation with
            the fingerprint of what was staged and of what it may replace (`files.journal`). Putting
            it in place (one rename) is the commit point: before it the transaction never happened;
            after it, it did, even if the process dies during the renames that follow.
  ledger    who wrote what (`files.ledger`, kept outside the folder); a replaced output is one the
            ledger says this command wrote, checked again at commit time under the folder's lock.

A commit holds the lock of every folder it touches (in a fixed order) while it checks what is at
each final path, records the new fingerprints, writes the journal and renames; each rename checks
again, on the object it renames, that it replaces only what the journal says (`files.renames`).
`recover(folder)` (before anything is staged into a folder, and in every command's output checks)
takes the same lock and, for each run whose lock it can take, carries out its journal or, without
one, removes what it staged; what it finished, undid and left alone is said in one line.

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
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from dsparkctl.errors import InputError
from dsparkctl.files import journal, ledger
from dsparkctl.files.journal import JOURNAL, LOCK, Op, Outcome, recover  # noqa: F401 - recover's home for callers
from dsparkctl.files.ledger import command, set_command  # noqa: F401 - the writer's identity, set by the CLI
from dsparkctl.files.modes import honour_umask, seal_dir
from dsparkctl.files.ownership import replace_refusal
from dsparkctl.files.renames import crash_point, identify, remove
from dsparkctl.signals import deferred

_STATE: dict[str, int] = {"n": 0}
_HELD: dict[Path, int] = {}  # folder -> fd of this run's lock file there
_DESC: dict[Path, dict[str, Any]] = {}  # folder -> what its lock file says: {"journal", "staged": {name: record}}
_OPEN: list["Transaction"] = []


WRITTEN: list[Path] = []  # every file or folder this process put in place, so an interruption can say so


def _abs(p: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.path.expanduser(p)))


def _hold(folder: Path) -> None:
    """Create and lock this run's lock file in `folder` (once per folder)."""
    if folder in _HELD:
        return
    path = folder / LOCK.format(journal.RUN_ID)
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
    _describe(folder)


def _describe(folder: Path) -> None:
    """Write into this run's lock file in `folder` what decides the fate of what it staged there."""
    fd = _HELD.get(folder)
    if fd is None:
        return
    desc = _DESC.setdefault(folder, {"journal": None, "staged": {}})
    doc = {"tool": "dsparkctl", "command": command(), "folder": str(folder), **desc}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(doc, allow_nan=False).encode(), 0)


def _note(staged: Path, record: list | None) -> None:
    """The lock file names `staged` by `record` (its identity, or its fingerprint once written)."""
    if record is not None:
        _DESC.setdefault(staged.parent, {"journal": None, "staged": {}})["staged"][staged.name] = record
        _describe(staged.parent)


def _release(folder: Path) -> None:
    fd = _HELD.pop(folder, None)
    if fd is None:
        return
    if not _DESC.pop(folder, {}).get("journal"):  # a journal not carried out entirely: the next run finishes it
        with contextlib.suppress(OSError):
            os.unlink(folder / LOCK.format(journal.RUN_ID))
    os.close(fd)


def _moved(folder: Path) -> InputError:
    return InputError(f"the output folder {folder} was moved, removed or replaced while this command ran; nothing "
                      "was written there", "run the command again (a later run removes what this one staged)")


@dataclass
class Transaction:
    """Outputs that appear together or not at all (module doc). `file(final)`/`folder(final)` give
    the hidden path to write; `commit()` puts them all in place."""
    writer: str
    private: Path | None = None  # torchrun's other ranks: outputs go here and are deleted
    ops: list[Op] = field(default_factory=list)
    prunes: list[tuple[Path, re.Pattern[str]]] = field(default_factory=list)  # (folder, names), see `prune`
    made: list[Path] = field(default_factory=list)  # folders created for the outputs, removed on abort
    homes: dict[Path, tuple[int, int]] = field(default_factory=dict)  # each output folder as it was at staging

    def _stage(self, final: str | os.PathLike, is_folder: bool, on_exists: str = "replace",
               ours: Callable[[Path], bool] | None = None) -> Path:
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
        st = os.stat(final.parent)
        self.homes.setdefault(final.parent, (st.st_dev, st.st_ino))
        staged = final.with_name(f".{final.name}.{journal.RUN_ID}-{_STATE['n']}.new")
        if is_folder:
            staged.mkdir()
            honour_umask(staged, directory=True)
            st = os.lstat(staged)
            _note(staged, ["ident", st.st_dev, st.st_ino])
        self.ops.append(Op(final, staged, is_folder, on_exists, ours=ours))
        return staged

    def file(self, final: str | os.PathLike, ours: Callable[[Path], bool] | None = None) -> Path:
        """The hidden path to write `final` to; `ours` (a cache's own rule) says what at `final` it may replace."""
        return self._stage(final, False, ours=ours)

    def folder(self, final: str | os.PathLike, on_exists: str = "replace") -> Path:
        return self._stage(final, True, on_exists)

    def sealed(self, staged: str | os.PathLike) -> None:
        """A writer finished the staged file `staged`: its lock file names it by fingerprint from now on."""
        staged = _abs(staged)
        if self.private is None and any(op.staged == staged for op in self.ops):
            _note(staged, identify(staged))

    def prune(self, folder: str | os.PathLike, pattern: str) -> None:
        """At the commit point, remove the files of `folder` whose names match `pattern` and that
        this command wrote, but this transaction does not write: an earlier run's set that the new
        one no longer holds (a figure of a position the new draft lacks). Decided under the folder's
        lock at commit time, so a run committing between our start and our commit is seen."""
        self.prunes.append((_abs(folder), re.compile(pattern, re.DOTALL)))

    def _pruned(self) -> list[Op]:
        """The delete ops `prune` asked for, computed now (under the folders' locks)."""
        mine = {op.final for op in self.ops}
        ops = []
        for folder, pattern in self.prunes:
            with contextlib.suppress(OSError):
                for name in sorted(os.listdir(folder)):
                    final = folder / name
                    if pattern.fullmatch(name) and final not in mine and ledger.writer_of(final) == self.writer:
                        _STATE["n"] += 1
                        ops.append(Op(final, final.with_name(f".{name}.{journal.RUN_ID}-{_STATE['n']}.new"), False,
                                      delete=True, old=identify(final)))
        return ops

    def staged_name(self, path: str | os.PathLike) -> bool:
        p = _abs(path)
        return any(op.staged == p for op in self.ops)

    def _seal(self) -> list[Op]:
        """Every staged output on disk and fingerprinted (those never written are no outputs)."""
        for folder, ident in self.homes.items():
            try:
                st = os.stat(folder)
            except OSError:
                raise _moved(folder) from None
            if (st.st_dev, st.st_ino) != ident:
                raise _moved(folder)
        ops = []
        for op in [op for op in self.ops if os.path.lexists(op.staged)]:  # on disk before the commit point
            if op.folder:
                op.new = identify(op.staged)  # (the modes seal_dir sets are no part of it)
                _note(op.staged, op.new)  # a folder named by fingerprint: a file put in it since is seen
                seal_dir(op.staged)
            else:
                with open(op.staged, "rb") as fh:
                    os.fsync(fh.fileno())
                op.new = identify(op.staged)
            ops.append(op)
        return ops

    def _judge(self, ops: list[Op]) -> list[Op]:
        """Under the folders' locks: what is at each final path now may be replaced (its fingerprint
        is kept: the renames replace exactly that), or the commit is refused before it happens."""
        judged = []
        for op in ops:
            if op.delete:
                judged.append(op)
                continue
            if op.on_exists == "keep" and os.path.lexists(op.final):
                remove(op.staged)  # another run built the same entry first: theirs stays
                continue
            if op.on_exists == "refuse" and os.path.lexists(op.final):
                raise InputError(f"{op.final} was created by another process while this command ran; this "
                                 "run's copy was discarded", "check that the other run's output is the one you want")
            before = identify(op.final)
            why = replace_refusal(op.final, ours=op.ours, as_folder=op.folder)
            if not why and identify(op.final) != before:
                why = "changed while it was checked"
            if why and op.ours is not None:  # a cache entry: what is there stays, this entry is not written
                journal.say(f"{op.final} {why}; left as it is (this cache entry was not written)")
                remove(op.staged)
                continue
            if why:
                raise InputError(f"{op.final} {why}; refusing to replace it",
                                 "choose a new path, or remove it yourself (nothing was written)")
            op.old = before
            judged.append(op)
        return judged

    def commit(self) -> list[Path]:
        if not self.ops or self.private is not None:
            return []
        ops = self._seal()
        crash_point("sealed")
        first = ops[0].final.parent if ops else self.ops[0].final.parent
        folders = sorted({op.final.parent for op in ops} | {first})
        with contextlib.ExitStack() as stack:
            for f in folders:
                try:
                    stack.enter_context(ledger.folder_lock(f))
                except (FileNotFoundError, NotADirectoryError):
                    raise _moved(f) from None
            ops = self._judge(ops + [op for op in self._pruned() if op.final.parent in folders])
            with deferred():  # a signal here waits: the commit is a few renames
                out = self._commit(ops, first / JOURNAL.format(journal.RUN_ID), folders) if ops else Outcome()
        self.ops = []
        if out.kept:
            final, where = out.kept[0]
            also = f"; also: {out.words()}" if len(out.kept) > 1 or out.left else ""
            raise InputError(f"{final} was put there by someone else while this command ran; it was left as it is, "
                             f"and this run's version was saved as {where}{also}",
                             f"keep the one you want under {final.name}: `mv {where} {final}` keeps this run's")
        if out.left or out.failed:
            raise InputError(f"this command's outputs are in place, except: {out.words()}",
                             "check those paths; a later run finishes what could not be done")
        return out.done

    def _commit(self, ops: list[Op], journal_path: Path, folders: list[Path]) -> Outcome:
        """Under the folders' locks, signals deferred: record, journal (the commit point), rename."""
        for f in folders:  # each lock file names every folder: a recovery of one undoes the run in all
            _hold(f)
            _DESC[f].update(journal=str(journal_path), folders=[str(x) for x in folders])
        for op in ops:
            if not op.delete:
                _DESC[op.final.parent]["staged"][op.staged.name] = op.new
        for f in folders:
            _describe(f)
        crash_point("intent")
        by_folder: dict[Path, dict[str, tuple[str, list | None]]] = {}
        for op in ops:
            by_folder.setdefault(op.final.parent, {})[op.final.name] = (self.writer, ledger.fingerprint(op.staged))
        for f, changes in by_folder.items():
            ledger.record(f, changes, keep_old=True)
        crash_point("ledger")
        doc = {"tool": "dsparkctl", "command": self.writer, "folder": str(journal_path.parent),
               "ops": [op.doc() for op in ops]}
        with open(journal_path.with_suffix(".tmp"), "w") as fh:
            json.dump(doc, fh, allow_nan=False)
            fh.flush()
            os.fsync(fh.fileno())
        crash_point("journal-written")
        os.replace(journal_path.with_suffix(".tmp"), journal_path)  # the commit point
        crash_point("commit-point")
        out = journal.apply(ops, self.writer, journal.RUN_ID)
        WRITTEN.extend(out.done)
        if not out.failed:
            with contextlib.suppress(OSError):
                journal_path.unlink()
            for f in folders:
                _DESC[f] = {"journal": None, "staged": {n: r for n, r in _DESC[f]["staged"].items()
                                                        if n not in {op.staged.name for op in ops}}}
                with contextlib.suppress(OSError):
                    _describe(f)
        return out

    def abort(self) -> None:
        for op in self.ops:
            remove(op.staged)
            _DESC.get(op.staged.parent, {}).get("staged", {}).pop(op.staged.name, None)
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
