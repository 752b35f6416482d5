"""Recovery of a killed run after the user moved, replaced or filled its folders (hostile cases C02-C05):
a run whose commit point is not provably absent is never undone, an undo reaches every folder the
run staged into, and a staged folder is removed only while it holds nothing but what was staged.
The kill is real (the harness of tests/test_journal_interference.py)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from dsparkctl.files import commit, journal
from dsparkctl.files.atomic import write_json
from tests.test_journal_interference import USER_NOTE, _child, _run_id, _tags, _two, _write


def _hidden(*folders: Path) -> list[str]:
    return sorted(p.name for f in folders if f.exists() for p in f.iterdir() if p.name.startswith("."))


def _killed_two(tmp_path: Path, point: str) -> tuple[Path, Path]:
    """`one` (its first folder: the journal's) and `two`, after a run killed at `point`."""
    one, two, msg = tmp_path / "one", tmp_path / "two", tmp_path / "msg.txt"
    assert _child(_two(one, two, "old"), msg) == 0
    assert _child(_two(one, two, "new"), msg, point) == -signal.SIGKILL
    return one, two


def test_a_committed_run_whose_journal_folder_was_removed_and_remade_is_left_and_said_once(tmp_path):
    """C02: a new folder at the journal folder's path is not where the journal went."""
    one, two = _killed_two(tmp_path, "commit-point")
    shutil.rmtree(one)
    one.mkdir()  # (the next run makes its output folder again)
    said: list[str] = []
    journal.recover(two, tell=said.append)
    journal.recover(two, tell=said.append)  # each output check of a command recovers again: said once
    assert len(said) == 1 and "cannot tell whether" in said[0] and "left as they are" in said[0], said
    assert [n for n in _hidden(two) if n.startswith(".b.json.")]  # kept: the run did commit
    assert _tags(two / "b.json") == ["old"]


def test_a_committed_run_whose_journal_folder_was_renamed_is_finished_where_it_went(tmp_path):
    """C03: the folder moved aside, a new one of the user's at its path: the journal is found by identity."""
    one, two = _killed_two(tmp_path, "commit-point")
    one.rename(tmp_path / "moved")
    one.mkdir()
    (one / "mine.txt").write_text(USER_NOTE)
    said: list[str] = []
    journal.recover(two, tell=said.append)
    assert len(said) == 1 and "finished the commit" in said[0] and "2 of 2" in said[0], said
    assert "before its commit point" not in said[0]
    assert _tags(tmp_path / "moved" / "a.json", two / "b.json") == ["new", "new"]
    assert (one / "mine.txt").read_text() == USER_NOTE and sorted(os.listdir(one)) == ["mine.txt"]
    assert _hidden(one, two, tmp_path / "moved") == []


def test_an_undone_run_is_undone_in_every_folder_it_staged_into(tmp_path):
    """C04: recovering one folder of a run that never committed removes its staged files in the other too
    (a rerun refused for another reason never comes back to that folder)."""
    one, two = _killed_two(tmp_path, "journal-written")
    said: list[str] = []
    journal.recover(two, tell=said.append)
    assert len(said) == 1 and "undid" in said[0] and "removed 2 staged output(s)" in said[0], said
    assert _hidden(one, two) == [] and _tags(one / "a.json", two / "b.json") == ["old", "old"]


def test_a_staged_folder_the_user_put_a_file_in_is_left_and_said(tmp_path):
    """C05: killed once its outputs were sealed; the user stores a file in the staged folder."""
    out, msg = tmp_path / "out", tmp_path / "msg.txt"
    assert _child(_write(out, "new"), msg, "sealed") == -signal.SIGKILL
    (staged,) = out.glob(f".draft.{_run_id(out)}-*.new")
    (staged / "mine.txt").write_text(USER_NOTE)
    said: list[str] = []
    journal.recover(out, tell=said.append)
    assert (staged / "mine.txt").read_text() == USER_NOTE
    assert len(said) == 1 and "left alone, not provably what it staged" in said[0] and str(staged) in said[0]
    assert not list(out.glob(".a.json.*.new"))  # the staged file still what it staged goes


def test_a_staged_folder_killed_while_written_is_the_runs_partial_and_goes(tmp_path):
    """Killed while writing a folder (the lock names it by identity only): that hidden folder, under the
    run's own name, is its partial and goes, full or empty (a killed extract must be cleanable by the
    next run: tests/test_partials.py). Once written, its content is recorded: see the test above."""
    msg = tmp_path / "msg.txt"
    for name, fill in [("full", True), ("empty", False)]:
        out = tmp_path / name

        def run(out: Path = out, fill: bool = fill) -> None:
            with commit.transaction() as tx:
                d = tx.folder(out / "draft")
                write_json(tx.file(out / "a.json"), {"run": "new"})
                if fill:
                    (d / "weights.bin").write_bytes(b"x" * 64)
                os.kill(os.getpid(), signal.SIGKILL)
        assert _child(run, msg) == -signal.SIGKILL
        said: list[str] = []
        journal.recover(out, tell=said.append)
        left = [n for n in _hidden(out) if n.startswith(".draft.")]
        assert left == [] and len(said) == 1 and "undid" in said[0], (name, said)
        assert not [n for n in _hidden(out) if not n.startswith(".draft.")]
