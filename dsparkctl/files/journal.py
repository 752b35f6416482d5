"""A commit's journal, and the recovery that keeps its promise (the terms: `files.commit`).

The journal lists every operation of a commit with two fingerprints: `new`, what the run staged,
and `old`, what it found and checked at the final path (null: nothing was there). Whoever carries
the journal out, the commit itself or the next run's `recover`, acts on those facts alone, each
checked on the very object renamed (`files.renames`):

  final is `new`            done already (a staged name left holds our `old`, or is a second link)
  staged is `new`, final    put in place (what was there goes)
    is free or `old`
  staged is `new`, final    left alone: someone put it there. Our version is kept beside it,
    is anything else        `NAME.dsparkctl-new-<run>` (a cache entry is dropped instead)
  staged is not `new`       left alone: not what the run staged
  a delete                  only of exactly `old`

A run that died before its commit point is undone, in every folder it staged into: its staged files
go, but only those still what it staged (the lock file names each by fingerprint once written; a
folder still being written, by identity only, goes only while empty). A run whose journal may be in
a folder that is gone or replaced (none holds its lock file written there) may have committed: it
is left as it is. A folder moved since is followed (ops of a folder the recovery
cannot find are left, with the journal, for a later run there). One line per run says it all.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dsparkctl.files import ledger, renames
from dsparkctl.files.ledger import fingerprint
from dsparkctl.files.renames import (crash_point, folder_ident, identify, keep_beside, remove, replace_checked,
                                     take_away, within)
from dsparkctl.strict_json import loads

RUN_ID = secrets.token_hex(6)  # this process
LOCK = ".dsparkctl-run.{}.lock"
JOURNAL = ".dsparkctl-commit.{}.json"
LOCK_RE = re.compile(r"\.dsparkctl-run\.([0-9a-f]{12})\.lock")
_MAX_DOC = 64 << 20
_SAID: set[str] = set()  # the lines of runs left as they are, said already


@dataclass
class Op:
    final: Path
    staged: Path
    folder: bool
    on_exists: str = "replace"  # a path that holds something at commit time: "replace" it if this command
    # wrote it (else refuse); "refuse" (an output that appeared meanwhile wins: an error); "keep" it and
    # discard this run's copy quietly (a cache entry any run builds alike)
    delete: bool = False  # an earlier output of this command that this run's set no longer holds
    new: list | None = None  # the staged version's fingerprint, taken at the commit
    old: list | None = None  # what the commit found at `final` and may replace (None: nothing may be)
    ours: Callable[[Path], bool] | None = None  # a cache's own rule for what it may replace
    cache: bool = False  # a cache entry: where it cannot go, it is dropped (not kept beside)

    @property
    def aside(self) -> Path:
        return self.staged.with_name(self.staged.name[: -len(".new")] + ".old")

    def doc(self) -> dict[str, Any]:
        return {"final": str(self.final), "staged": str(self.staged), "folder": self.folder, "delete": self.delete,
                "on_exists": self.on_exists, "new": self.new, "old": self.old,
                "cache": self.cache or self.ours is not None}

    @classmethod
    def of(cls, d: dict[str, Any], where: Path | None = None) -> "Op":
        final, staged = Path(d["final"]), Path(d["staged"])
        if where is not None:
            final, staged = where / final.name, where / staged.name
        fps = [d.get(k) if isinstance(d.get(k), list) else None for k in ("new", "old")]
        return cls(final, staged, bool(d["folder"]), str(d.get("on_exists", "replace")), bool(d.get("delete")),
                   fps[0], fps[1], cache=bool(d.get("cache")))


@dataclass
class Outcome:
    """What carrying out a journal did: each a (path, words) pair."""
    done: list[Path] = field(default_factory=list)
    kept: list[tuple[Path, Path]] = field(default_factory=list)  # (final, where our version went)
    left: list[tuple[Path, str]] = field(default_factory=list)  # not ours: untouched
    failed: list[tuple[Path, str]] = field(default_factory=list)  # an OS error: left for the next run

    def words(self) -> str:
        said = []
        if self.kept:
            said.append("kept its version beside yours: " + ", ".join(f"{w} (yours stays at {f.name})"
                                                                      for f, w in self.kept))
        if self.left:
            said.append("left alone, not what it wrote: " + ", ".join(f"{p} ({why})" for p, why in self.left))
        if self.failed:
            said.append("could not finish: " + ", ".join(f"{p} ({why})" for p, why in self.failed))
        return "; ".join(said)


def apply(ops: list[Op], writer: str, run: str) -> Outcome:
    """Carry out a committed journal (idempotent: the next run may do it again), under the locks of
    every folder involved, then record in the ledgers what is ours now."""
    out = Outcome()
    for op in ops:
        try:
            (_delete if op.delete else _place)(op, run, out)
        except OSError as e:
            out.failed.append((op.final, e.strerror or str(e)))
        crash_point("applied")
    crash_point("renamed")
    by_folder: dict[Path, dict[str, tuple[str, list | None]]] = {}
    for op in ops:
        now = fingerprint(op.final)
        if now is None or now == op.new:  # ours now, or gone: anything else at the path is not recorded
            by_folder.setdefault(op.final.parent, {})[op.final.name] = (writer, now)
    for folder, changes in by_folder.items():
        with contextlib.suppress(OSError):
            ledger.record(folder, changes, keep_old=False)
    crash_point("recorded")
    return out


def _place(op: Op, run: str, out: Outcome) -> None:
    now, staged = identify(op.final), identify(op.staged)
    if now is not None and now == op.new:
        out.done.append(op.final)
        if staged is not None and staged in (op.old, op.new):  # our old version swapped out, or a second link
            renames.drop(op.staged, op.aside)
        elif os.path.lexists(op.staged):
            out.left.append((op.staged, "not what this run staged: put there since"))
    elif staged is None or staged != op.new:
        if staged is not None and staged == op.old:  # swapped out by the rename, its successor replaced since
            renames.drop(op.staged, op.aside)
            out.left.append((op.final, "changed or replaced after this run put it there"))
        elif os.path.lexists(op.staged):
            out.left.append((op.staged, "not what this run staged: put there since"))
        elif now is not None and now != op.old:
            out.left.append((op.final, "changed or replaced after this run put it there"))
        elif now is not None:
            out.left.append((op.staged, f"gone before it took its name: {op.final.name} keeps its earlier version"))
    elif replace_checked(op.staged, op.final, op.old, op.aside):
        out.done.append(op.final)
    elif op.cache or op.on_exists == "keep":
        remove(op.staged)  # a cache entry: whoever else's is there stays
    else:
        out.kept.append((op.final, keep_beside(op.staged, op.final, run)))
    _tidy(op, out)


def _delete(op: Op, run: str, out: Outcome) -> None:
    now = identify(op.final)
    if now is not None and now == op.old:
        if take_away(op.final, op.aside, op.old):
            out.done.append(op.final)
        else:
            out.left.append((op.final, "changed since this run decided to remove it"))
    elif now is not None:
        out.left.append((op.final, "changed since this run decided to remove it"))
    _tidy(op, out)


def _tidy(op: Op, out: Outcome) -> None:
    """The hidden old version of an op (a replaced folder on its way out): removed if it is ours,
    whole or partly removed already; put back if it is someone's and its path is free."""
    if not os.path.lexists(op.aside):
        return
    if within(identify(op.aside), op.old):
        remove(op.aside)
    elif not os.path.lexists(op.final):
        renames.put_new(op.aside, op.final)
    else:
        out.left.append((op.aside, "not what this run set aside"))


def say(line: str) -> None:
    print(f"note: {line}", file=sys.stderr, flush=True)


def recover(folder: str | os.PathLike, tell: Callable[[str], None] = say) -> list[str]:
    """Finish or undo what dead runs left in `folder` (module doc): one line per run to `tell`; the
    notes returned name each path removed."""
    folder = Path(os.path.abspath(os.path.expanduser(folder)))
    try:
        listing = os.listdir(folder)
    except OSError:
        return []
    notes: list[str] = []
    for run in [m[1] for n in listing if (m := LOCK_RE.fullmatch(n)) and m[1] != RUN_ID]:
        if (fd := _dead(lock := folder / LOCK.format(run))) is None:
            continue
        try:
            line, drop_lock = _recover_run(folder, run, _read_doc(fd), notes)
            if line and line not in _SAID:
                notes.append(line)
                tell(line)
            if drop_lock:
                with contextlib.suppress(OSError):
                    lock.unlink()
            else:
                _SAID.add(line)  # left as it is: said once per process, not at each of its checks
        finally:
            os.close(fd)
    return notes


def _dead(lock: Path) -> int | None:
    """An open, flocked descriptor of a dead run's lock file (ours, a regular file); None otherwise."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    with contextlib.suppress(OSError):
        if _regular(os.fstat(fd)):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails: alive (or no flock: nothing provably dead)
            return fd
    os.close(fd)
    return None


def _read_doc(fd: int) -> dict[str, Any]:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    try:
        doc = loads(b"".join(chunks) or b"{}")
    except (ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _recover_run(here: Path, run: str, doc: dict[str, Any], notes: list[str]) -> tuple[str, bool]:
    """(the line that says what was done, whether the run's lock in `here` may go)."""
    recorded = Path(doc["journal"]) if isinstance(doc.get("journal"), str) else None
    if recorded is not None and recorded.name != JOURNAL.format(run):
        recorded = None
    at = _now_at(recorded.parent, run, doc, here, recorded.name) if recorded is not None else here
    journal = next((j for j in ([at / recorded.name] if recorded and at else []) + [here / JOURNAL.format(run)]
                    if _ours(j)), None)
    if journal is not None:
        done = _roll_forward(journal, run, here)
        if done is not None:
            return done
        with contextlib.suppress(OSError):
            journal.unlink()  # damaged: never a commit point (that is a whole file put in place by one rename)
    if at is None:  # its journal may be in a folder that is gone or replaced: it may have committed
        return (f"cannot tell whether the `dsparkctl {doc.get('command', '?')}` run {run} that died in {here} passed "
                f"its commit point: its journal's folder {recorded.parent} is gone or is another folder now; its "
                f"staged outputs here (.*.{run}-*.new) are left as they are (fix: move that folder back and run "
                "again, or delete them)"), False
    return _roll_back(here, run, doc, notes), True


def _now_at(was: Path, run: str, doc: dict[str, Any], here: Path, need: str = "") -> Path | None:
    """Where the dead run's folder `was` is now: `here` (the lock's own), or `was` or a folder beside it that
    holds the run's lock file written in `was` (renamed); None: none does (removed, or remade at its path)."""
    if was in (Path(doc["folder"] if isinstance(doc.get("folder"), str) else here), here):
        return here
    with contextlib.suppress(OSError):
        for at in [was] + [was.parent / n for n in sorted(os.listdir(was.parent)) if n != was.name]:
            if (_ours(at / LOCK.format(run)) and _lock_doc(at / LOCK.format(run)).get("folder") == str(was)
                    and (at == was or not need or _ours(at / need))):  # renamed: followed to its journal only
                return at
    return None


def _lock_doc(lock: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError):
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            return _read_doc(fd)
        finally:
            os.close(fd)
    return {}


def _ours(p: Path) -> bool:
    with contextlib.suppress(OSError):
        return _regular(p.lstat())
    return False


def _regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_size <= _MAX_DOC


def _roll_back(here: Path, run: str, doc: dict[str, Any], notes: list[str]) -> str:
    """Undo a run that never committed, in `here` and in every other folder its lock names (each still
    that folder): its lock there goes too."""
    removed, left = _undo(here, run, doc, notes)
    folders = doc.get("folders") if isinstance(doc.get("folders"), list) else []
    for was in [f for f in folders if isinstance(f, str)]:
        other = _now_at(Path(was), run, doc, here)
        if other is None or other == here or (fd := _dead(other / LOCK.format(run))) is None:
            continue
        try:
            more, also = _undo(other, run, _read_doc(fd), notes)
            removed, left = removed + more, left + also
            with contextlib.suppress(OSError):
                (other / LOCK.format(run)).unlink()
        finally:
            os.close(fd)
    if not removed and not left:
        return ""
    line = (f"undid the unfinished `dsparkctl {doc.get('command', '?')}` run {run} in {here} (it died before its "
            f"commit point): removed {removed} staged output(s)")
    if left:
        line += "; left alone, not provably what it staged: " + ", ".join(f"{p} ({why})" for p, why in left)
    return line


def _undo(here: Path, run: str, doc: dict[str, Any], notes: list[str]) -> tuple[int, list[tuple[Path, str]]]:
    """Remove the run's staged files in `here` that are still what it staged: (outputs removed, those left)."""
    staged = doc.get("staged") if isinstance(doc.get("staged"), dict) else {}
    removed, left = 0, []
    with ledger.folder_lock(here):
        for p in leftovers(here, run):
            if p.name.endswith(".old"):  # only a committed run sets an old version aside
                continue
            rec = staged.get(p.name)
            if why := (_unlike(p, rec) if isinstance(rec, list) else None):
                left.append((p, why))
                continue
            remove(p)
            removed += p.name.endswith(".new")
            notes.append(f"removed {p}: a stale partial of a run that died before its commit")
    return removed, left


def _unlike(p: Path, rec: list) -> str | None:
    """Why `p` is not provably what the lock file recorded (None: it is): its fingerprint (or part of it: a
    removal cut short). A folder the run died writing is recorded by its identity alone: the same
    folder, hidden under the run's own name, is taken as the run's partial (a killed extract must be
    cleanable by the next run), though a file put inside it since could not be told apart."""
    if rec[:1] == ["ident"]:
        return None if folder_ident(p) == rec[1:3] else "not what it staged"
    return None if within(identify(p), rec) else "not what it staged"


def leftovers(folder: Path, run: str) -> list[Path]:
    pat = re.compile(rf"\..+\.{run}-\d+\.(new|old)|\.dsparkctl-commit\.{run}\.(tmp|json)", re.DOTALL)
    try:
        return [folder / n for n in os.listdir(folder) if pat.fullmatch(n)]
    except OSError:
        return []


def _roll_forward(journal: Path, run: str, here: Path) -> tuple[str, bool] | None:
    """Carry out a dead run's journal; None when it is not one (damaged)."""
    try:
        doc = loads(journal.read_bytes())
        base = Path(doc.get("folder") or journal.parent)
        ops = [Op.of(o) for o in doc["ops"]]
        writer = str(doc["command"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    ops = [op for op in ops if op.staged.parent == op.final.parent and op.final.is_absolute()
           and re.fullmatch(rf"\.{re.escape(op.final.name)}\.{run}-\d+\.new", op.staged.name, re.DOTALL)]
    ops = _relocate(ops, base, journal.parent, here)
    missing = sorted({op.final.parent for op in ops if not op.final.parent.is_dir()})
    reach = [op for op in ops if op.final.parent.is_dir()]
    folders = sorted({op.final.parent for op in reach} | {journal.parent, here})
    with contextlib.ExitStack() as stack:
        for f in folders:
            stack.enter_context(ledger.folder_lock(f))
        out = apply(reach, writer, run)
        if not missing and not out.failed:  # the journal's folder's lock last: it says the journal was there
            locks = [f / LOCK.format(run) for f in folders if f != journal.parent]
            for p in locks + [journal, journal.parent / LOCK.format(run)]:
                with contextlib.suppress(OSError):
                    p.unlink()
    line = (f"finished the commit of the `dsparkctl {writer}` run {run} that died during it ({journal.parent}): "
            f"{len(out.done)} of {len(ops)} output(s) in place")
    if out.words():
        line += "; " + out.words()
    if missing:
        line += (f"; its folder(s) {', '.join(map(str, missing))} are gone (moved or removed): their outputs wait, "
                 f"with the journal {journal}, for a run in their new place (fix: run it there, or delete the journal)")
    return line, not missing and not out.failed


def _relocate(ops: list[Op], base: Path, at: Path, here: Path) -> list[Op]:
    """The ops as the folders are now: the journal's own folder where the journal now is; a folder that
    is gone, `here`, when `here` holds its staged or finished outputs (it was moved here)."""
    where = {base: at} if base != at else {}
    parents = {op.final.parent for op in ops}
    for p in sorted(parents - set(where)):
        if p.is_dir() or here in parents or here in where.values():
            continue
        mine = [op for op in ops if op.final.parent == p]
        if any(os.path.lexists(here / op.staged.name)
               or (op.new is not None and identify(here / op.final.name) == op.new) for op in mine if not op.delete):
            where[p] = here
    return [Op.of(op.doc(), where[op.final.parent]) if op.final.parent in where else op for op in ops]
