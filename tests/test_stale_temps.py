"""Temporary files of a killed writer are removed by the next write to the same path; a live
writer's are not (each writer holds a lock on its temp file; the kernel drops it on SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dsparkctl.fsutil import atomic_open, remove_stale_temps

ROOT = Path(__file__).resolve().parents[1]
WRITER = """
import sys, time
sys.path.insert(0, {root!r})
from dsparkctl.fsutil import atomic_open
with atomic_open({path!r}, "w") as fh:
    fh.write("partial")
    fh.flush()
    print("writing", flush=True)
    time.sleep(60)
"""


def _writer(path: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT), path=str(path))],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    return p


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_sigkilled_writer_leaves_a_temp_that_the_next_write_removes(tmp_path):
    out = tmp_path / "t.jsonl"
    p = _writer(out)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert len(temps(tmp_path)) == 1 and not out.exists()  # what SIGKILL leaves
    with atomic_open(out, "w") as fh:
        fh.write("complete\n")
    assert out.read_text() == "complete\n" and temps(tmp_path) == []


def test_a_live_writers_temp_and_foreign_files_are_left_alone(tmp_path):
    out = tmp_path / "t.jsonl"
    p = _writer(out)
    try:
        mine = temps(tmp_path)
        (tmp_path / ".t.jsonl.notes.tmp").write_text("a user's file")  # not our 8-character pattern
        (tmp_path / ".other.abcd1234.tmp").write_text("another output's temp")
        assert remove_stale_temps(out) == []
        assert set(mine) <= set(temps(tmp_path)) and ".t.jsonl.notes.tmp" in temps(tmp_path)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait()
    time.sleep(0.1)
    assert ".other.abcd1234.tmp" in temps(tmp_path)
