"""`extract` killed at random points (SIGTERM, SIGHUP, SIGKILL; several seeds), then rerun: TERM and
HUP unwind and leave nothing; what SIGKILL leaves, the rerun removes; OUT ends complete and
verified. Plus the stale-partial rule, case by case (dsparkctl/checkpoint/partials.py)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dsparkctl.checkpoint import partials
from dsparkctl.checkpoint.fixtures import Dims, write_fixture
from dsparkctl.checkpoint.source import open_local

# ~300 MB checkpoint, ~260 MB of it in the three draft shards extract reads
SIGNAL_DIMS = replace(Dims(), hidden=1024, vocab=8192, q_lora=256, q_out=2048, kv=256, wo_a=(1024, 512),
                      experts=96, moe_inter=512, shared_inter=512, rank=128, sink=16, layers=4, target_experts=1)
# the real `extract` command, without importing the engine (torch) at start-up
ENTRY = "import typer; from dsparkctl.cli import checkpoint; app = typer.Typer(); checkpoint.register(app); app()"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    return write_fixture(tmp_path_factory.mktemp("big") / "ckpt", "v4.1-flash", SIGNAL_DIMS)


def _extract(src: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ENTRY, "extract", str(src), str(out), *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _partials(out: Path) -> set[str]:
    return {p.name for p in out.parent.iterdir() if partials.partial_pattern(out).fullmatch(p.name)}


def _wait_for_claim(proc: subprocess.Popen, out: Path, old: set[str]) -> Path:
    """Block until this run's partial folder holds its owner file; returns the folder."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for name in _partials(out) - old:
            if (out.parent / name / partials.OWNER).exists():
                return out.parent / name
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.002)
    raise AssertionError("extract never claimed a partial folder")


def _wait_for_progress(proc: subprocess.Popen, folder: Path, nbytes: int) -> None:
    """Block until `nbytes` of tensor data sit in the partial folder (allocated blocks: the shards
    are created at full length and filled by pwrite), or the run ends."""
    while proc.poll() is None:
        with contextlib.suppress(OSError):
            if sum(e.stat().st_blocks * 512 for e in os.scandir(folder)) >= nbytes:
                return
        time.sleep(0.001)


@pytest.mark.slow  # kills and reruns extract many times (over a minute)
def test_killed_extracts_leave_nothing_a_rerun_cannot_clean(big: Path, tmp_path: Path):
    out = tmp_path / "OUT"
    total = sum(big_t.nbytes for big_t in map(open_local(big).tensor, open_local(big).draft_names()))
    hits = 0
    for seed in (0, 1, 2):
        rng = random.Random(seed)
        order = [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL]
        rng.shuffle(order)
        for sig in order:
            old = _partials(out)
            proc = _extract(big, out)
            _wait_for_progress(proc, _wait_for_claim(proc, out, old), int(rng.uniform(0.0, 0.9) * total))
            proc.send_signal(sig)
            rc = proc.wait(60)
            _, stderr = proc.communicate()
            if rc == 0:  # finished before the signal: not a hit, start over
                shutil.rmtree(out)
                continue
            hits += 1
            assert not out.exists(), (seed, sig)
            assert not (old & _partials(out)), f"a stale partial survived a rerun: {old}"
            if sig == signal.SIGKILL:
                assert rc == -signal.SIGKILL and len(_partials(out)) == 1
            else:
                assert rc == 130, (sig, stderr)
                assert "interrupted" in stderr and "Traceback" not in stderr, stderr
                assert _partials(out) == set(), (sig, _partials(out))
        left = _partials(out)
        proc = _extract(big, out, "--verify", "--json")
        rc = proc.wait(120)
        stdout, stderr = proc.communicate()
        assert rc == 0, stderr
        assert _partials(out) == set(), "a stale partial survived the rerun"
        assert all(f"removed {out.parent / name}" in stderr for name in left), stderr
        assert json.loads(stdout)["verified"] is True  # every tensor re-read and matched to its source bytes
        assert sorted(open_local(out).weight_map) == sorted(open_local(big).draft_names())
        shutil.rmtree(out)
    assert hits >= 8, f"only {hits} of 9 signals landed while extract ran"


# --------------------------------------------------------------------------- the stale rule, case by case
def _owner(folder: Path, out_dir: Path, **changes) -> Path:
    doc = {"tool": "dsparkctl", "command": "extract", "out": out_dir.name, "pid": 2 ** 22 + 7,
           "host": os.uname().nodename, "created": 0.0, **changes}
    (folder / partials.OWNER).write_text(json.dumps(doc))
    return folder / partials.OWNER


def _dead(folder: Path, out: Path) -> None:
    folder.mkdir()
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"x" * 100)
    _owner(folder, out)


def _old_empty(folder: Path, out: Path) -> None:
    folder.mkdir()
    os.utime(folder, (time.time() - 2 * partials.STALE_EMPTY_S,) * 2)


def _new_empty(folder: Path, out: Path) -> None:
    folder.mkdir()


def _no_owner(folder: Path, out: Path) -> None:
    folder.mkdir()
    (folder / "user-notes.txt").write_text("mine")
    os.utime(folder, (time.time() - 2 * partials.STALE_EMPTY_S,) * 2)


def _other_out(folder: Path, out: Path) -> None:
    folder.mkdir()
    _owner(folder, out, out="SOMETHING-ELSE")


def _other_tool(folder: Path, out: Path) -> None:
    folder.mkdir()
    _owner(folder, out, tool="not-us")


def _symlink(folder: Path, out: Path) -> None:
    target = folder.parent / "elsewhere"
    target.mkdir()
    (target / "precious").write_text("mine")
    _owner(target, out)
    folder.symlink_to(target)


def _damaged_owner(folder: Path, out: Path) -> None:
    folder.mkdir()
    (folder / partials.OWNER).write_text("[" * 4000)  # nested deeper than a JSON reader recurses


def _a_file(folder: Path, out: Path) -> None:
    folder.write_text("mine")


RULES = [  # (case, builder, removed?, words of the note)
    ("claimed by a dead run", _dead, True, "stale partial of a run that died"),
    ("empty, old", _old_empty, True, "empty leftover"),
    ("empty, recent", _new_empty, False, "empty but recent"),
    ("files but no owner file", _no_owner, False, "no owner file"),
    ("owner file of another OUT", _other_out, False, "not ours"),
    ("owner file of another tool", _other_tool, False, "not ours"),
    ("a symlink to a claimed folder", _symlink, False, "not a folder"),
    ("a file", _a_file, False, "not a folder"),
    ("a damaged owner file", _damaged_owner, False, "not ours"),
]


@pytest.mark.parametrize("case,build,removed,words", RULES, ids=[r[0] for r in RULES])
def test_stale_partial_rule(case, build, removed, words, tmp_path: Path):
    out = tmp_path / "OUT"
    folder = tmp_path / ".OUT.abc_1234.partial"
    build(folder, out)
    notes = partials.remove_stale(out)
    assert len(notes) == 1 and words in notes[0], notes
    assert os.path.lexists(folder) != removed, case
    assert not (tmp_path / "elsewhere").exists() or (tmp_path / "elsewhere" / "precious").exists()


def test_a_running_extract_keeps_its_partial(tmp_path: Path):
    """The owner file is locked while its run lives: a second run leaves it alone."""
    out = tmp_path / "OUT"
    folder = tmp_path / ".OUT.abc_1234.partial"
    folder.mkdir()
    with open(_owner(folder, out), "rb") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        notes = partials.remove_stale(out)
    assert folder.exists() and "a running extract" in notes[0]


def test_claim_empties_the_folder_before_dropping_the_owner_file(tmp_path: Path):
    out, tmp = tmp_path / "OUT", tmp_path / ".OUT.abc_1234.partial"
    tmp.mkdir()
    with pytest.raises(KeyboardInterrupt):
        with partials.claim(tmp, out):
            (tmp / "a.safetensors").write_bytes(b"1")
            assert json.loads((tmp / partials.OWNER).read_text())["pid"] == os.getpid()
            raise KeyboardInterrupt
    assert list(tmp.iterdir()) == []
