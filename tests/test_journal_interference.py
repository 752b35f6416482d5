"""Kill a commit at each of its steps, let a user interfere, then recover and run again: the journal
only ever replaces what it wrote, and nothing of the user's is lost (files/commit.py, journal.py,
renames.py, atomic.py; the caches that write through them).

The kill is real: the commit runs in a forked child that sends itself SIGKILL at the named step
(`renames.crash_point`), so no `finally` and no handler runs. Then the user acts, `recover` runs,
and a third run writes the same outputs again. The expected outcome of every cell is spelled by
`expected()` below; `python tests/test_journal_interference.py` prints the table.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
from pathlib import Path
from typing import Callable

import pytest

from dsparkctl.errors import InputError
from dsparkctl.files import commit, journal, renames
from dsparkctl.files.atomic import atomic_open, write_json

USER_A = "the user's own a.json, written by hand\n"
USER_NOTE = "the user's notes\n"


# -------- the runs: each in a forked child (its own run id, its own locks), killed at a step or not
def _child(fn: Callable[[], None], msg: Path, point: str | None = None, nth: int = 1, fallback: bool = False) -> int:
    """Run `fn` in a forked child that SIGKILLs itself at crash point `point` (its `nth` time);
    its exit code (-9 when killed, 2 on an InputError, whose message goes to `msg`)."""
    run = secrets.token_hex(6)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            journal.RUN_ID = run
            commit._STATE["n"] = 0
            for d in (commit._HELD, commit._DESC):
                d.clear()
            commit._OPEN.clear()
            renames.SYSCALL["enabled"] = not fallback
            seen: dict[str, int] = {}

            def hook(name: str) -> None:
                seen[name] = seen.get(name, 0) + 1
                if name == point and seen[name] == nth:
                    os.kill(os.getpid(), signal.SIGKILL)
            renames.CRASH_HOOKS[:] = [hook]
            commit.set_command("calibrate")
            fn()
        except InputError as e:
            msg.write_text(e.one_line())
            code = 2
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            msg.write_text(f"{type(e).__name__}: {e}")
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _write(out: Path, tag: str) -> Callable[[], None]:
    """One command's outputs: a folder (a draft export) and a file, under one commit point."""
    def run() -> None:
        with commit.transaction() as tx:
            d = tx.folder(out / "draft")
            (d / "config.json").write_text(json.dumps({"run": tag}))
            (d / "weights.bin").write_bytes(tag.encode() * 64)
            write_json(tx.file(out / "a.json"), {"run": tag})
    return run


# -------- the table's rows and columns
# (id, crash point, its nth time, without renameat2, committed, the folder op done, the file op done)
KILLS = [
    ("outputs-written", "sealed", 1, False, False, False, False),
    ("intent-recorded", "intent", 1, False, False, False, False),
    ("ledger-recorded", "ledger", 1, False, False, False, False),
    ("journal-written", "journal-written", 1, False, False, False, False),
    ("commit-point", "commit-point", 1, False, True, False, False),
    ("folder-swapped", "swapped", 1, False, True, True, False),
    ("folder-stepped-aside", "stepped-aside", 1, True, True, False, False),
    ("folder-done", "applied", 1, False, True, True, False),
    ("file-swapped", "swapped", 2, False, True, True, True),
    ("all-renamed", "renamed", 1, False, True, True, True),
    ("ledger-updated", "recorded", 1, False, True, True, True),
]
INTERFERENCES = ["nothing", "user-file-at-final", "user-file-in-folder", "folder-renamed", "folder-removed",
                 "staged-replaced"]


def expected(kill: tuple, interference: str) -> str:
    """What the user finds after the recovery, then after a third run of the same command."""
    _, _, _, _, committed, folder_done, file_done = kill
    aside = kill[0] == "folder-stepped-aside"  # the old draft stepped aside, the new one not yet in place
    a = "new" if committed else "old"
    draft = "new" if committed else "old"
    extra, nxt = "", "next run writes"
    if interference == "folder-removed":
        return "nothing left (you removed it); next run writes"
    if interference == "folder-renamed" and not committed:
        nxt = "next run refused (a moved folder's files are on no record)"
    if interference == "user-file-at-final":
        a = "yours (ours beside it)" if committed and not file_done else "yours"
        nxt = "next run refused (a.json is yours)"
    if interference == "user-file-in-folder":
        if aside:
            draft = "yours (ours beside it)"
        elif committed and not folder_done:
            draft = "old + your file (ours beside it)"
        else:
            draft += " + your file"
        nxt = "next run refused (draft is yours)"
    if interference == "staged-replaced":
        if committed and not file_done:
            a = "old"
        extra = "; your file at its staged name left alone"
    return f"a.json {a}, draft {draft}{extra}; said; {nxt}"


def _state(p: Path, kept: list[str]) -> str:
    beside = " (ours beside it)" if any(k.startswith(p.name + ".dsparkctl-new-") for k in kept) else ""
    if not os.path.lexists(p):
        return "gone" + beside
    if p.is_dir():
        cfg = p / "config.json"
        mine = sorted(set(os.listdir(p)) - {"config.json", "weights.bin"})
        if not cfg.exists():
            return "yours" + beside
        tag = json.loads(cfg.read_text())["run"]
        assert (p / "weights.bin").read_bytes() == tag.encode() * 64, "a whole draft"
        return tag + (" + your file" if mine else "") + beside
    text = p.read_text()
    return ("yours" if text == USER_A else json.loads(text)["run"]) + beside


def _interfere(out: Path, how: str, run: str) -> Path:
    """What the user does between the kill and the next run; the folder the outputs are in now."""
    if how == "user-file-at-final":
        (out / "a.json").unlink(missing_ok=True)
        (out / "a.json").write_text(USER_A)
    elif how == "user-file-in-folder":
        (out / "draft").mkdir(exist_ok=True)
        (out / "draft" / "mine.txt").write_text(USER_NOTE)
    elif how == "folder-renamed":
        out.rename(out.with_name("moved"))
        return out.with_name("moved")
    elif how == "folder-removed":
        shutil.rmtree(out)
    elif how == "staged-replaced":
        staged = out / f".a.json.{run}-2.new"
        staged.unlink(missing_ok=True)
        staged.write_text(USER_A)
    return out


def _run_id(out: Path) -> str:
    locks = [p.name for p in out.iterdir() if journal.LOCK_RE.fullmatch(p.name)]
    assert len(locks) == 1, locks
    return journal.LOCK_RE.fullmatch(locks[0])[1]


@pytest.mark.parametrize("interference", INTERFERENCES)
@pytest.mark.parametrize("kill", KILLS, ids=[k[0] for k in KILLS])
def test_a_killed_commit_then_a_user_then_the_next_run(tmp_path, kill, interference):
    name, point, nth, fallback, *_ = kill
    out, msg = tmp_path / "out", tmp_path / "msg.txt"
    assert _child(_write(out, "old"), msg) == 0, msg.read_text()
    assert _child(_write(out, "new"), msg, point, nth, fallback) == -signal.SIGKILL
    where = _interfere(out, interference, _run_id(out) if out.exists() else "")
    candidates = [where / "a.json", where / "draft" / "mine.txt", *where.glob(".a.json.*.new")]
    users = {p: p.read_text() for p in candidates if p.exists() and p.read_text() in (USER_A, USER_NOTE)}
    said: list[str] = []
    journal.recover(where, tell=said.append)
    for p, text in users.items():
        assert p.read_text() == text, f"the user's {p.name} was changed"
    if not where.exists():
        seen = "nothing left (you removed it)"
    else:
        kept = sorted(p.name for p in where.iterdir() if ".dsparkctl-new-" in p.name)
        for k in kept:
            assert _state(where / k, []) == "new", "what is kept beside is this run's whole version"
        hidden = sorted(p.name for p in where.iterdir() if p.name.startswith("."))
        assert hidden == [p.name for p in users if p.parent == where and p.name.startswith(".")], hidden
        seen = f"a.json {_state(where / 'a.json', kept)}, draft {_state(where / 'draft', kept)}"
        seen += "; your file at its staged name left alone" if any(p.name.startswith(".") for p in users) else ""
        assert len(said) == 1, said
        seen += "; said"
    rc = _child(_write(where, "third"), msg)
    if rc == 0:
        assert _state(where / "a.json", []) == _state(where / "draft", []) == "third"
        seen += "; next run writes"
    else:
        assert rc == 2, msg.read_text()
        why = msg.read_text()
        assert "refusing to replace it" in why and "nothing was written" in why
        blame = ("a.json is yours" if interference == "user-file-at-final" else "draft is yours"
                 if interference == "user-file-in-folder" else "a moved folder's files are on no record")
        seen += f"; next run refused ({blame})"
    for p, text in users.items():
        assert p.read_text() == text, f"the user's {p.name} was changed by the next run"
    assert seen == expected(kill, interference)


# -------- the recovery itself killed at each of its steps: the next recovery ends where one whole would have
@pytest.mark.parametrize("interference", ["nothing", "user-file-at-final"])
@pytest.mark.parametrize("point,nth", [("swapped", 1), ("applied", 1), ("swapped", 2), ("renamed", 1),
                                       ("recorded", 1)], ids=["folder-swapped", "folder-done", "file-swapped",
                                                              "all-renamed", "ledger-updated"])
def test_a_recovery_killed_midway_is_finished_by_the_next(tmp_path, point, nth, interference):
    out, msg = tmp_path / "out", tmp_path / "msg.txt"
    assert _child(_write(out, "old"), msg) == 0
    assert _child(_write(out, "new"), msg, "commit-point") == -signal.SIGKILL
    _interfere(out, interference, _run_id(out))
    rc = _child(lambda: journal.recover(out, tell=lambda line: None), msg, point, nth)
    assert rc == -signal.SIGKILL or (rc == 0 and point == "swapped" and interference != "nothing")  # (no swap)
    journal.recover(out, tell=lambda line: None)
    kept = sorted(p.name for p in out.iterdir() if ".dsparkctl-new-" in p.name)
    a = "yours (ours beside it)" if interference == "user-file-at-final" else "new"
    assert (_state(out / "a.json", kept), _state(out / "draft", kept)) == (a, "new")
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


# -------- a transaction over two folders, one of them moved between the kill and the next run
def _two(one: Path, two: Path, tag: str) -> Callable[[], None]:
    def run() -> None:
        with commit.transaction() as tx:
            write_json(tx.file(one / "a.json"), {"run": tag})
            write_json(tx.file(two / "b.json"), {"run": tag})
    return run


def _tags(*paths: Path) -> list:
    return [json.loads(p.read_text())["run"] if p.exists() else None for p in paths]


def test_a_committed_run_whose_other_folder_moved_is_finished_there_when_a_run_comes(tmp_path):
    one, two, msg = tmp_path / "one", tmp_path / "two", tmp_path / "msg.txt"
    assert _child(_two(one, two, "old"), msg) == 0
    assert _child(_two(one, two, "new"), msg, "commit-point") == -signal.SIGKILL
    two.rename(tmp_path / "moved")
    said: list[str] = []
    journal.recover(one, tell=said.append)
    assert _tags(one / "a.json", tmp_path / "moved" / "b.json") == ["new", "old"]
    assert "are gone (moved or removed): their outputs wait" in said[0] and "1 of 2 output(s)" in said[0]
    journal.recover(tmp_path / "moved", tell=said.append)  # a run there finishes it
    assert _tags(one / "a.json", tmp_path / "moved" / "b.json") == ["new", "new"] and len(said) == 2
    assert not [p.name for f in (one, tmp_path / "moved") for p in f.iterdir() if p.name.startswith(".")]


def test_a_run_that_cannot_tell_whether_it_committed_leaves_its_staged_files_and_says_so(tmp_path):
    one, two, msg = tmp_path / "one", tmp_path / "two", tmp_path / "msg.txt"
    assert _child(_two(one, two, "old"), msg) == 0
    assert _child(_two(one, two, "new"), msg, "journal-written") == -signal.SIGKILL  # before the commit point
    one.rename(tmp_path / "away")  # the journal's folder: had it committed, the journal would be in there
    said: list[str] = []
    journal.recover(two, tell=said.append)
    assert "cannot tell whether" in said[0] and "left as they are" in said[0]
    assert [p.name for p in two.iterdir() if p.name.endswith(".new")]  # kept: it might have committed
    (tmp_path / "away").rename(one)
    journal.recover(two, tell=said.append)  # back: no journal there, so it never committed
    journal.recover(one, tell=said.append)
    assert "undid" in said[1] and _tags(one / "a.json", two / "b.json") == ["old", "old"]
    assert not [p.name for f in (one, two) for p in f.iterdir() if p.name.startswith(".")]


def test_a_run_whose_ledger_cannot_be_written_still_replaces_its_own_output(tmp_path, monkeypatch, capsys):
    (tmp_path / "state").write_text("not a folder")
    monkeypatch.setenv("DSPARKCTL_STATE", str(tmp_path / "state"))
    write_json(tmp_path / "latest.json", {"step": 1})
    write_json(tmp_path / "latest.json", {"step": 2})  # a checkpoint's pointer, rewritten in one run
    assert json.loads((tmp_path / "latest.json").read_text()) == {"step": 2}


# -------- no kill: a user's file appears at a step of a live commit
@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "no-renameat2"])
@pytest.mark.parametrize("point,placed", [
    pytest.param(p, placed, id=f"{p}-{'ours-kept-beside' if placed else 'refused'}") for p, placed in [
        ("sealed", False), ("intent", True), ("ledger", True), ("journal-written", True), ("commit-point", True),
        ("checked", True)]])
def test_a_users_file_that_appears_during_a_commit_is_never_replaced(tmp_path, point, placed, fallback):
    """Before the folders' locks are taken, the commit sees it and writes nothing; after, its
    journal is promised: the rest goes in place, the user's file stays, ours is kept beside it."""
    out, msg = tmp_path / "out", tmp_path / "msg.txt"
    assert _child(_write(out, "old"), msg) == 0

    def run() -> None:
        def hook(name: str) -> None:
            if name == point and not (out / "a.json").read_text() == USER_A:
                (out / "a.json").unlink()
                (out / "a.json").write_text(USER_A)
        renames.CRASH_HOOKS.append(hook)
        _write(out, "new")()
    assert _child(run, msg, fallback=fallback) == 2
    assert (out / "a.json").read_text() == USER_A
    kept = [p.name for p in out.iterdir() if ".dsparkctl-new-" in p.name]
    if placed:
        assert "was put there by someone else while this command ran" in msg.read_text()
        assert _state(out / "draft", []) == "new" and len(kept) == 1 and _state(out / kept[0], []) == "new"
    else:
        assert "refusing to replace it" in msg.read_text() and _state(out / "draft", []) == "old" and not kept
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_an_output_folder_swapped_mid_run_is_said_not_a_raw_error(tmp_path):
    out, msg = tmp_path / "out", tmp_path / "msg.txt"
    assert _child(_write(out, "old"), msg) == 0

    def run() -> None:
        with commit.transaction() as tx:
            write_json(tx.file(out / "a.json"), {"run": "new"})
            out.rename(tmp_path / "elsewhere")  # the user moves the folder away and makes a new one
            out.mkdir()
            (out / "a.json").write_text(USER_A)
    assert _child(run, msg) == 2
    assert "was moved, removed or replaced while this command ran" in msg.read_text()
    assert (out / "a.json").read_text() == USER_A
    assert json.loads((tmp_path / "elsewhere" / "a.json").read_text()) == {"run": "old"}
    journal.recover(tmp_path / "elsewhere", tell=lambda line: None)  # the dead run's staged file there goes
    assert not [p.name for p in (tmp_path / "elsewhere").iterdir() if p.name.startswith(".")]


# -------- writes outside a transaction (generate --trace, served --out, the caches)
@pytest.mark.parametrize("fallback", [False, True], ids=["renameat2", "no-renameat2"])
@pytest.mark.parametrize("when", ["during-the-run", "at-the-rename"])
@pytest.mark.parametrize("before", ["nothing", "our-earlier-file"])
def test_an_atomic_write_never_replaces_a_file_put_there_during_the_run(tmp_path, monkeypatch, before, when,
                                                                        fallback):
    monkeypatch.setitem(renames.SYSCALL, "enabled", not fallback)
    path = tmp_path / "t.jsonl"
    if before == "our-earlier-file":
        write_json(path, {"run": "old"})

    def users() -> None:
        path.unlink(missing_ok=True)
        path.write_text(USER_A)
    if when == "at-the-rename":  # after the check, before the rename (of our earlier file: after it was judged ours)
        at = "checked" if before == "our-earlier-file" else "written"
        monkeypatch.setattr(renames, "CRASH_HOOKS", [lambda n: users() if n == at else None])
    with pytest.raises(InputError, match="it was left as it is, and this run's output was saved as") as e:
        with atomic_open(path) as fh:
            fh.write("our long run's trace\n")
            if when == "during-the-run":
                users()
    assert path.read_text() == USER_A
    (kept,) = [p for p in tmp_path.iterdir() if ".dsparkctl-new-" in p.name]
    assert kept.read_text() == "our long run's trace\n" and str(kept) in e.value.one_line()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_an_atomic_write_that_finds_its_very_bytes_there_leaves_them(tmp_path):
    """Another rank's copy of one data cache file, a user's identical copy: nothing to replace, nothing lost."""
    path = tmp_path / "prompts.json"
    path.write_text('{\n  "run": "same"\n}\n')
    before = os.lstat(path).st_ino
    write_json(path, {"run": "same"})
    assert os.lstat(path).st_ino == before and sorted(os.listdir(tmp_path)) == ["prompts.json"]


def test_an_atomic_write_replaces_its_own_earlier_file(tmp_path):
    path = tmp_path / "t.jsonl"
    write_json(path, {"run": "old"})
    write_json(path, {"run": "new"})
    assert json.loads(path.read_text()) == {"run": "new"} and sorted(os.listdir(tmp_path)) == ["t.jsonl"]


# -------- the caches replace only an entry they recognise as theirs
def _continuations(tmp_path: Path, monkeypatch) -> tuple[Callable[[], list[str]], Path]:
    from dsparkctl.evaluation.continuations import cached_continuations, continuations_key
    from dsparkctl.math.sampling import SamplingParams
    from tests.tiny_models import tiny_target

    monkeypatch.setenv("DSPARKCTL_CONTINUATIONS_CACHE", str(tmp_path))
    model, prompts = tiny_target("llama"), [[5, 6, 7], [8, 9]]
    key = continuations_key(model, prompts, SamplingParams(0.0), 4, [1], 0, 8)

    def run() -> list[str]:
        logs: list[str] = []
        cached_continuations(model, prompts, SamplingParams(0.0), 4, [1], log=logs.append)
        return logs
    return run, tmp_path / f"{key}.json"


def _kernels(tmp_path: Path, monkeypatch) -> tuple[Callable[[], list[str]], Path]:
    from dsparkctl.engine.kernel_choice import remember_choice
    from dsparkctl.models.packed_linear import Route
    from tests.tiny_models import tiny_target

    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(tmp_path / "k.json"))
    model = tiny_target("llama")

    def run() -> list[str]:
        logs: list[str] = []
        remember_choice(model, Route(packed=True, stock_rows=2), {}, logs.append)
        return logs
    return run, tmp_path / "k.json"


def _sps(tmp_path: Path, monkeypatch) -> tuple[Callable[[], list[str]], Path]:
    from dsparkctl.engine import sps_cache
    from dsparkctl.files.ownership import NotOurs
    from dsparkctl.formats.sps import table_json
    from dsparkctl.math.sps import SPSTable

    path = tmp_path / ("0" * 24 + ".json")
    doc = table_json(SPSTable([1, 4], [50.0, 40.0], meta={"cached_by": "generate"}))

    def run() -> list[str]:  # the writing step of machine_sps_table, without profiling a model
        try:
            write_json(path, doc, ours=sps_cache._entry)
            return []
        except NotOurs as e:
            return [e.message]
    return run, path


@pytest.mark.parametrize("when", ["before-the-run", "during-the-run"])
@pytest.mark.parametrize("cache", ["continuations", "kernel-choices", "sps-tables"])
def test_a_cache_never_replaces_a_file_it_cannot_recognise(tmp_path, monkeypatch, cache, when):
    run, path = {"continuations": _continuations, "kernel-choices": _kernels, "sps-tables": _sps}[cache](
        tmp_path, monkeypatch)
    assert run() == [] and path.is_file()  # its own entry: written, and replaced by the next run
    assert run() == [] or cache == "continuations"  # (a continuations hit writes nothing)
    user = '{"my": "settings, not a cache entry"}\n'

    def users() -> None:
        path.unlink(missing_ok=True)
        path.write_text(user)
    if when == "before-the-run":
        users()
    else:  # put there after the cache decided, before its rename
        path.unlink()
        monkeypatch.setattr(renames, "CRASH_HOOKS", [lambda n: users() if n == "written" else None])
    logs = run()
    assert path.read_text() == user
    assert any("left as it is" in m for m in logs), logs
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def _table() -> str:
    rows = ["| kill point | " + " | ".join(INTERFERENCES) + " |", "|---" * (len(INTERFERENCES) + 1) + "|"]
    for kill in KILLS:
        rows.append(f"| {kill[0]} | " + " | ".join(expected(kill, i) for i in INTERFERENCES) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(_table() + "\n")
