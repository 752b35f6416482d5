"""Nothing of a user's is replaced (issue 20, class 1 and 5): `files.ownership.replace_refusal` is the one
rule ("a new path, or a regular file we wrote"), applied by `check_outputs` to every file output,
by `save_figure`, and by the kernel-choice cache; `files.atomic.staged` makes a command's outputs appear
together or not at all. Each case asserts exit code, message and the files left."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.files.atomic import atomic_open, remove_stale_temps, staged, write_json
from dsparkctl.files.os_errors import os_error_words
from dsparkctl.files.ownership import replace_refusal
from dsparkctl.formats.trace import write_synthetic_trace
from dsparkctl.math.synthetic import SyntheticModel
from tests.helpers import snapshot

runner = CliRunner()


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


def _make(path: Path, kind: str, tmp: Path) -> None:
    from dsparkctl.files import commit

    if kind == "user json":
        path.write_text('{"my": "settings"}\n')
    elif kind == "user json with a format":
        path.write_text('{"format": "something-else/1"}\n')
    elif kind == "user png":
        path.write_bytes(b"\x89PNG\r\n\x1a\n my holiday photo")
    elif kind == "user text":
        path.write_text("notes\n")
    elif kind == "user file in our format":  # looks exactly like ours: still the user's
        path.write_text(json.dumps({"format": "dsparkctl-calibration/1", "provenance": {"tool": "dsparkctl"}}))
    elif kind == "user sglang sts":  # SGLang's format, which we also write
        path.write_text(json.dumps({"temperatures": [1.0], "dataset": "t", "num_samples": 1, "ece_before": [0.0],
                                    "ece_after": [0.0]}))
    elif kind == "copy of ours":
        write_json(tmp / "elsewhere.json", {"format": "dsparkctl-calibration/1", "x": 1})
        shutil.copy(tmp / "elsewhere.json", path)
    elif kind == "ours edited by hand":
        write_json(path, {"format": "dsparkctl-calibration/1", "x": 1})
        time.sleep(0.01)
        with open(path, "a") as fh:
            fh.write(" ")
    elif kind == "ours, ledger deleted":
        write_json(path, {"format": "dsparkctl-calibration/1", "x": 1})
        from dsparkctl.files.ledger import ledger_path
        ledger_path(path.parent).unlink()
    elif kind == "another command's":
        commit.set_command("train")
        try:
            write_json(path, {"format": "dsparkctl-calibration/1", "x": 1})
        finally:
            commit.set_command(None)
    elif kind == "symlink to ours":
        write_json(tmp / "ours.json", {"format": "dsparkctl-calibration/1"})
        path.symlink_to(tmp / "ours.json")
    elif kind == "dangling symlink":
        path.symlink_to(tmp / "nowhere")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "ours json":
        write_json(path, {"format": "dsparkctl-calibration/1", "x": 1})
    elif kind == "ours, any content":
        write_json(path, {"temperatures": [1.0]})


NO_RECORD = "exists and dsparkctl has no record of writing it there"


@pytest.mark.parametrize("kind,refusal", [
    ("user json", NO_RECORD),
    ("user json with a format", NO_RECORD),
    ("user png", NO_RECORD),
    ("user text", NO_RECORD),
    ("user file in our format", NO_RECORD),
    ("user sglang sts", NO_RECORD),
    ("copy of ours", NO_RECORD),
    ("ours edited by hand", NO_RECORD),
    ("ours, ledger deleted", NO_RECORD),
    ("another command's", "was written by `dsparkctl train`, not by this command"),
    ("symlink to ours", "is a symbolic link"),
    ("dangling symlink", "is a symbolic link"),
    ("fifo", "is not a regular file (a FIFO, socket or device)"),
    ("ours json", None),
    ("ours, any content", None),
    ("nothing", None),
])
def test_replace_refusal(tmp_path, kind, refusal):
    """Ownership is what the ledger recorded for this command, never what the file looks like."""
    p = tmp_path / "x.json"
    _make(p, kind, tmp_path)
    assert replace_refusal(p) == refusal


def test_a_device_is_never_ours():
    assert replace_refusal("/dev/null") == "is not a regular file (a FIFO, socket or device)"


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("trace")
    write_synthetic_trace(d / "t.jsonl", SyntheticModel(), 40, 10, seed=1)
    return d / "t.jsonl"


@pytest.mark.parametrize("kind,where,code,message", [
    ("user json", "out", 2, "--out {p} " + NO_RECORD + "; refusing to replace it"),
    ("user file in our format", "out", 2, "--out {p} " + NO_RECORD),
    ("symlink to ours", "out", 2, "--out {p} is a symbolic link; refusing to replace it"),
    ("fifo", "out", 2, "--out {p} is not a regular file"),
    ("user json", "sglang", 2, "--sglang-out {p} " + NO_RECORD),
    ("user sglang sts", "sglang", 2, "--sglang-out {p} " + NO_RECORD),
    ("user png", "png", 2, "{p} " + NO_RECORD + "; refusing to replace it"),
    ("another command's", "out", 2, "--out {p} was written by `dsparkctl train`, not by this command"),
    ("nothing", "out", 0, None),
])
def test_calibrate_replaces_only_what_it_wrote(tmp_path, trace, kind, where, code, message):
    out = tmp_path / "calib.json"
    plots = tmp_path / "calib_reliability"
    plots.mkdir()
    p = {"out": out, "sglang": tmp_path / "calib.sglang-sts.json", "png": plots / "reliability_pos2.png"}[where]
    _make(p, kind, tmp_path)
    before = snapshot(tmp_path)
    r = runner.invoke(app, ["calibrate", str(trace), "--out", str(out)])
    assert r.exit_code == code, r.output
    if code:
        assert message.format(p=p) in r.output and len(r.output.strip().splitlines()) == 1
        assert snapshot(tmp_path) == before  # nothing left, created or changed: not one PNG
    else:
        assert json.loads(out.read_text())["format"] == "dsparkctl-calibration/1"
        r = runner.invoke(app, ["calibrate", str(trace), "--out", str(out)])  # our own outputs: replaced again
        assert r.exit_code == 0, r.output


@pytest.mark.parametrize("suffix", [".jpg", ".tif", ".svgz", ".png"])
def test_a_figure_without_room_for_a_marker_is_replaced_by_the_command_that_drew_it(tmp_path, trace, suffix):
    """Ownership is the ledger's record, so a JPEG we drew is ours to redraw (it carries no mark)."""
    from dsparkctl.formats.sps import save_sps_table
    from dsparkctl.math.sps import SPSTable

    save_sps_table(SPSTable([1, 4, 16, 64], [50.0, 40.0, 35.0, 25.0]), tmp_path / "sps.json")
    argv = ["sweep-scheduler", "--trace", str(trace), "--sps-table", str(tmp_path / "sps.json"), "--policies",
            "static:1", "--concurrency", "1,4", "--rounds", "200", "--plot", str(tmp_path / f"f{suffix}")]
    for _ in range(2):
        r = runner.invoke(app, argv)
        assert r.exit_code == 0, r.output
    (tmp_path / f"f{suffix}").write_bytes((tmp_path / f"f{suffix}").read_bytes())  # rewritten by hand: the user's
    r = runner.invoke(app, argv)
    assert r.exit_code == 2 and "has no record of writing it there" in r.output, r.output


def test_calibrate_on_a_full_disk_leaves_no_output(tmp_path, trace, monkeypatch):
    import dsparkctl.plots as plots

    real, calls = plots.save_figure, []

    def full_after_two(fig, path, **kw):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(fig, path, **kw)
    monkeypatch.setattr(plots, "save_figure", full_after_two)
    r = runner.invoke(app, ["calibrate", str(trace), "--out", str(tmp_path / "calib.json")])
    assert r.exit_code == 2 and r.output.startswith("error: the disk is full") and "fix:" in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_staged_outputs_appear_together_or_not_at_all(tmp_path):
    with pytest.raises(RuntimeError):
        with staged() as stage:
            write_json(stage(tmp_path / "a.json"), {})
            write_json(stage(tmp_path / "new" / "b.json"), {})
            raise RuntimeError
    assert list(tmp_path.iterdir()) == []
    with staged() as stage:
        write_json(stage(tmp_path / "a.json"), {})
        write_json(stage(tmp_path / "new" / "b.json"), {})
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["a.json", "new", "new/b.json"]


@pytest.mark.parametrize("exc,words", [
    (OSError(errno.ENOSPC, "No space left on device", "/x"), "the disk is full (/x)"),
    (OSError(errno.EROFS, "Read-only file system"), "the file system is read-only"),
    (RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                  "\"No space left on device\" })"), "the disk is full"),
    (ValueError("not an OS error"), None),
])
def test_os_error_words(exc, words):
    got = os_error_words(exc)
    assert (got[0] if got else None) == words


@pytest.mark.parametrize("setup,code,message,left", [
    ("existing folder with a config", 2, "already exists", ["config.json"]),
    ("a file", 2, "already exists", None),
    ("empty folder", 0, None, None),
    ("new", 0, None, None),
])
def test_dev_fixture_never_writes_over_a_folder_of_the_users(tmp_path, setup, code, message, left):
    out = tmp_path / "fx"
    if setup == "existing folder with a config":
        out.mkdir()
        (out / "config.json").write_text('{"mine": 1}')
    elif setup == "a file":
        out.write_text("x")
    elif setup == "empty folder":
        out.mkdir()
    before = snapshot(tmp_path)
    r = runner.invoke(app, ["dev-fixture", str(out)])
    assert r.exit_code == code, r.output
    if code:
        assert message in r.output and snapshot(tmp_path) == before
        if left:
            assert sorted(p.name for p in out.iterdir()) == left and (out / "config.json").read_text() == '{"mine": 1}'
    else:
        assert (out / "config.json").is_file()


@pytest.mark.parametrize("dest", ["{src}/sub", "{src}/model.safetensors.d", "{src}"])
def test_extract_never_writes_inside_its_input(tmp_path, dest):
    src = tmp_path / "fx"
    assert runner.invoke(app, ["dev-fixture", str(src), "--layout", "deepspec-dspark"]).exit_code == 0
    before = snapshot(tmp_path)
    r = runner.invoke(app, ["extract", str(src), dest.format(src=src)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "inside the input folder" in r.output or "already exists" in r.output
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind,written", [
    ("user json", False), ("user json with a format", False), ("symlink to ours", False), ("dangling symlink", False),
    ("fifo", False), ("user text", False), ("nothing", True), ("ours kernel cache", True)])
def test_the_kernel_choice_cache_writes_only_its_own_file(tmp_path, monkeypatch, kind, written):
    from dsparkctl.engine.kernel_choice import remember_choice
    from dsparkctl.models.packed_linear import Route
    from tests.tiny_models import tiny_target

    path = tmp_path / "k.json"
    if kind == "ours kernel cache":
        path.write_text('{"format": "dsparkctl-cpu-kernels/1", "choices": {}}')
    else:
        _make(path, kind, tmp_path)
    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(path))
    before = snapshot(tmp_path)
    logs: list[str] = []
    remember_choice(tiny_target("llama"), Route(packed=True, stock_rows=2), {}, logs.append)
    if written:
        assert json.loads(path.read_text())["format"] == "dsparkctl-cpu-kernels/1" and logs == []
    else:
        assert snapshot(tmp_path) == before and len(logs) == 1 and "left as it is" in logs[0]


def test_the_kernel_choice_cache_never_touches_a_device(monkeypatch):
    from dsparkctl.engine.kernel_choice import remember_choice
    from dsparkctl.models.packed_linear import Route
    from tests.tiny_models import tiny_target

    monkeypatch.setenv("DSPARKCTL_CPU_KERNELS_CACHE", "/dev/null")
    st = os.stat("/dev/null")
    logs: list[str] = []
    remember_choice(tiny_target("llama"), Route(packed=True, stock_rows=2), {}, logs.append)
    assert "is not a regular file" in logs[0] and os.stat("/dev/null").st_rdev == st.st_rdev
    assert not [p for p in os.listdir("/dev") if p.startswith(".null.")]


@pytest.mark.parametrize("exc,code,line", [
    (RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
                  'device" })'), 2, "error: the disk is full (fix: free some space"),
    (OSError(errno.EROFS, "Read-only file system", "/x/y"), 2, "error: the file system is read-only (/x/y) (fix:"),
    (OSError(errno.ENOSPC, "No space left on device"), 2, "error: the disk is full (fix:"),
    (OSError(errno.EIO, "Input/output error"), 1, "error: OSError: [Errno 5] Input/output error"),
])
def test_environment_errors_are_one_line_exit_2(monkeypatch, exc, code, line):
    import typer

    from dsparkctl.cli.guard import guarded

    @guarded
    def cmd() -> None:
        raise exc
    app_ = typer.Typer()
    app_.command()(cmd)
    r = runner.invoke(app_, [])
    assert r.exit_code == code and r.output.startswith(line) and r.output.count("\n") == 1, r.output


@pytest.mark.parametrize("env, root", [
    ({}, "home/.cache/dsparkctl"),
    ({"XDG_CACHE_HOME": "xdg"}, "xdg/dsparkctl"),
    ({"DSPARKCTL_CACHE": "mine", "XDG_CACHE_HOME": "xdg"}, "mine"),
    ({"DSPARKCTL_CACHE": " ", "XDG_CACHE_HOME": ""}, "home/.cache/dsparkctl"),  # empty: unset
])
def test_every_cache_lives_under_the_one_cache_root(tmp_path, monkeypatch, env, root):
    from dsparkctl.engine import kernel_choice, sps_cache
    from dsparkctl.evaluation import continuations
    from dsparkctl.files.cache import cache_root
    from dsparkctl.models import embedded
    from dsparkctl.train.job import default_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("DSPARKCTL_CACHE", "XDG_CACHE_HOME", "DSPARKCTL_SPS_CACHE", "DSPARKCTL_CPU_KERNELS_CACHE",
                 "DSPARKCTL_CONTINUATIONS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path / value) if value.strip() else value)
    r = tmp_path / root
    assert cache_root() == embedded.cache_root() == r
    assert (default_cache_dir(), sps_cache.cache_dir(), kernel_choice.cache_path(), continuations.cache_dir()) == \
        (r / "train", r / "sps", r / "cpu_kernels.json", r / "continuations")
    monkeypatch.setenv("DSPARKCTL_SPS_CACHE", str(tmp_path / "own"))  # one cache's own place wins
    assert sps_cache.cache_dir() == tmp_path / "own"


@pytest.mark.parametrize("setup,refused", [("user files", True), ("empty", False), ("previous download", False)])
def test_download_never_writes_into_a_folder_of_the_users(tmp_path, monkeypatch, setup, refused):
    from dsparkctl.app import download as hub  # the command module calls the library's download

    d = tmp_path / "dl"
    d.mkdir()
    if setup == "user files":
        (d / "config.json").write_text('{"mine": 1}')
    elif setup == "previous download":
        (d / ".cache" / "huggingface").mkdir(parents=True)
        (d / "config.json").write_text("{}")
    from dsparkctl.errors import InputError

    def reached(*a, **k):
        raise InputError("reached the download")
    monkeypatch.setattr(hub, "download", reached)
    before = snapshot(tmp_path)
    r = runner.invoke(app, ["download", "org/name", "--local-dir", str(d)])
    if refused:
        assert r.exit_code == 2 and "holds files that no download wrote" in r.output and snapshot(tmp_path) == before
    else:
        assert "reached the download" in r.output, r.output


@pytest.mark.parametrize("writes,line", [(False, "interrupted; nothing was written"),
                                          (True, "interrupted; 1 file(s) were complete before it, e.g. ")])
def test_an_interruption_never_says_nothing_was_written_beside_a_written_output(tmp_path, monkeypatch, writes, line):
    import typer

    from dsparkctl.cli.guard import guarded
    from dsparkctl.files import atomic as fsutil

    monkeypatch.setattr(fsutil, "WRITTEN", [])

    @guarded
    def cmd() -> None:
        if writes:
            write_json(tmp_path / "out.json", {})
        raise KeyboardInterrupt
    app_ = typer.Typer()
    app_.command()(cmd)
    r = runner.invoke(app_, [])
    assert r.exit_code == 130 and r.output.startswith(line), r.output
    if writes:
        assert str(tmp_path / "out.json") in r.output


def test_an_opaque_writer_failure_on_a_full_disk_is_said_as_a_full_disk(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from dsparkctl.files.os_errors import full_disk_error

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(100, 100, 0))
    e = full_disk_error(RuntimeError("unexpected pos 704 vs 598"), tmp_path)
    assert e.errno == errno.ENOSPC and os_error_words(e)[0] == f"the disk is full ({tmp_path})"
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, 1 << 40))
    assert full_disk_error(RuntimeError("x"), tmp_path) is None


def test_writers_write_on_rank_zero_alone(tmp_path, monkeypatch):
    """Under torchrun the other ranks hold the same merged results: the atomic writers and the trace
    writer write nothing there (library code never asks its rank); `each_rank` files are written."""
    from dsparkctl import distributed
    from dsparkctl.files.atomic import append_line, atomic_dir, atomic_open, staged, write_json
    from dsparkctl.formats.trace import TraceWriter

    monkeypatch.setattr(distributed, "_WORLD", distributed.World(rank=1, size=2))
    write_json(tmp_path / "a.json", {"x": 1})
    with atomic_open(tmp_path / "b.txt") as fh:
        fh.write("b")
    with atomic_dir(tmp_path / "c") as tmp:
        (tmp / "f").write_text("c")
    with staged() as stage:
        write_json(stage(tmp_path / "d" / "d.json"), {})
    append_line(tmp_path / "e.jsonl", "{}")
    with TraceWriter(tmp_path / "t.jsonl", {}) as w:
        w.write([])
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    write_json(tmp_path / "mine.json", {"x": 1}, each_rank=True)
    with atomic_dir(tmp_path / "own", each_rank=True) as tmp:
        (tmp / "f").write_text("own")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json", "own"]
    monkeypatch.setattr(distributed, "_WORLD", distributed.World(rank=0, size=2))
    write_json(tmp_path / "a.json", {"x": 1})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}


# -------- temporary files: a killed writer's are removed by the next write to the same path, a live writer's are
# not (each writer holds a lock on its temp file; the kernel drops it on SIGKILL)
ROOT = Path(__file__).resolve().parents[1]
WRITER = """
import sys, time
sys.path.insert(0, {root!r})
from dsparkctl.files.atomic import atomic_open
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


def test_a_signal_while_outputs_go_in_place_lands_after_all_of_them(tmp_path, monkeypatch):
    """SIGTERM between two renames of `staged` (or of a draft folder's swap) would leave old and
    new outputs mixed: it is deferred to the end of the step, and every new output is in place
    and counted as written when the interrupt comes."""
    import os
    import signal

    import pytest

    from dsparkctl.files import atomic as fsutil
    from dsparkctl.signals import terminate_as_interrupt

    outs = [tmp_path / f"o{i}.json" for i in range(3)]
    for o in outs:
        fsutil.write_json(o, {"old": True})
    real = os.replace
    calls = []

    def replace_then_signal(src, dst):
        real(src, dst)
        calls.append(dst)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
    before = len(fsutil.WRITTEN)
    with terminate_as_interrupt(), pytest.raises(KeyboardInterrupt):
        with fsutil.staged() as stage:
            for o in outs:
                fsutil.write_json(stage(o), {"old": False})
            calls.clear()
            monkeypatch.setattr(fsutil.os, "replace", replace_then_signal)
    monkeypatch.setattr(fsutil.os, "replace", real)
    assert [json.loads(o.read_text()) for o in outs] == [{"old": False}] * 3
    assert fsutil.WRITTEN[before:][-3:] == outs and not list(tmp_path.glob(".*staged*"))


@pytest.mark.parametrize("argv,says", [
    (["--out", "{d}/c.json", "--plot-dir", "{d}/full"], "--plot-dir {d}/full is the output folder {d}/full of "
     "`dsparkctl serve-config`"),
    (["--out", "{d}/full/c.json"], "--out {d}/full/c.json is inside the output folder {d}/full of "
     "`dsparkctl serve-config`"),
])
def test_no_command_writes_into_another_commands_output_folder(tmp_path, trace, argv, says):
    from dsparkctl.files import commit
    from dsparkctl.files.atomic import atomic_dir

    commit.set_command("serve-config")
    try:
        with atomic_dir(tmp_path / "full") as tmp:  # an exported draft folder
            (tmp / "config.json").write_text("{}")
    finally:
        commit.set_command(None)
    before = snapshot(tmp_path)
    r = runner.invoke(app, ["calibrate", str(trace), *[a.format(d=tmp_path) for a in argv]])
    assert r.exit_code == 2 and says.format(d=tmp_path) in r.output, r.output
    assert snapshot(tmp_path) == before


def test_one_output_inside_another_whole_folder_output_is_refused(tmp_path):
    from dsparkctl.app.preflight import Output, check_outputs
    from dsparkctl.errors import UsageError

    with pytest.raises(UsageError, match="--export-vllm .*/g/sub is inside --export-full-vocab .*/g"):
        check_outputs([Output(tmp_path / "g", "--export-full-vocab", "folder"),
                       Output(tmp_path / "g" / "sub", "--export-vllm", "folder")])
    check_outputs([Output(tmp_path / "figs" / "c.json", "--out"),  # a place for named files may hold others
                   Output(tmp_path / "figs", "--plot-dir", "folder", whole=False)])
    assert not (tmp_path / "g").exists()


def test_a_temp_swept_between_its_creation_and_its_lock_is_made_again(tmp_path, monkeypatch):
    """Two writers of one folder (torchrun ranks sharing a data cache): the other's stale-temp sweep
    can take a temp file after mkstemp made it and before its writer locked it. The write must
    still land (it failed with FileNotFoundError at the rename before)."""
    import tempfile as tf

    import dsparkctl.files.atomic as atomic

    real, calls = tf.mkstemp, []

    def mkstemp_then_swept(*a, **kw):
        fd, name = real(*a, **kw)
        if not Path(name).name.startswith(".prompts.json."):
            return fd, name  # the ledger's own temp files
        calls.append(name)
        if len(calls) == 1:  # the first temp is swept away after its writer marked it, before it could lock it
            assert remove_stale_temps(tmp_path / "prompts.json") == []  # unmarked yet: not provably ours
            os.setxattr(fd, *atomic.TEMP_MARK)
            assert remove_stale_temps(tmp_path / "prompts.json") == [Path(name)]
        return fd, name

    monkeypatch.setattr(atomic.tempfile, "mkstemp", mkstemp_then_swept)
    write_json(tmp_path / "prompts.json", {"a": 1}, each_rank=True)
    assert json.loads((tmp_path / "prompts.json").read_text()) == {"a": 1}
    assert len(calls) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["prompts.json"]


def test_cannot_write_file_refuses_what_is_not_ours_to_replace(tmp_path):
    import os

    from dsparkctl.files.atomic import cannot_write_file

    (tmp_path / "a folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "mine [1].json").write_text("{}")
    os.symlink(tmp_path / "mine [1].json", tmp_path / "link")
    for name in ("a folder", "fifo", "link"):
        assert "not a regular file" in cannot_write_file(tmp_path / name)
    assert cannot_write_file(tmp_path / "mine [1].json") is None  # an earlier result: replaced atomically
    assert cannot_write_file(tmp_path / "new dir" / "x.json") is None
    (tmp_path / "file").write_text("")
    assert "is not a folder" in cannot_write_file(tmp_path / "file" / "x.json")


def test_a_users_file_named_like_a_temp_file_is_never_swept(tmp_path):
    """The stale-temp sweep used to go by name and lock alone: a user's `.out.json.abcd1234.tmp`
    (hostile round 5) was deleted by the next write of out.json. Only temp files this tool marked
    as it made them are swept."""
    out = tmp_path / "out.json"
    mine = tmp_path / ".out.json.abcd1234.tmp"
    mine.write_text("the user's notes")
    write_json(out, {"a": 1})
    assert mine.read_text() == "the user's notes"
    assert remove_stale_temps(out) == []
    # a temp file of ours left by a killed writer (marked, nobody locks it) is still swept
    from dsparkctl.files.atomic import TEMP_MARK
    dead = tmp_path / ".out.json.zz99yy88.tmp"
    dead.write_text("half")
    os.setxattr(dead, *TEMP_MARK)
    assert remove_stale_temps(out) == [dead] and mine.exists()
