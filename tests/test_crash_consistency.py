"""SIGKILL at every step of a command's write, then the next run: every output is its old complete
version or its new complete one (never a mix), nothing hidden is left, and a rerun works with no
manual cleanup (files/commit.py, files/ledger.py).

A kill at a random moment rarely lands in the few milliseconds a commit takes, so the killer counts
the command's file-system calls (rename, replace, unlink, fsync, mkdir, rmdir, ftruncate) and sends
itself SIGKILL at call K, for every K of the commit and a random sample before it. SIGKILL runs no
handler and no `finally`: what is on disk is what a real kill leaves. Plus N identical commands at
once on one output, and a resumed train that logs each step once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsparkctl.files import commit
from dsparkctl.formats.trace import write_synthetic_trace
from dsparkctl.math.synthetic import SyntheticModel

ROOT = Path(__file__).resolve().parents[1]
KILLER = r'''
import os, signal, sys
K, LOG = int(sys.argv[1]), sys.argv[2]
n = [0]
def counted(name):
    real = getattr(os, name)
    def call(*a, **k):
        n[0] += 1
        if n[0] == K:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    setattr(os, name, call)
if sys.argv[3] == "-c":
    code, sys.argv = sys.argv[4], sys.argv[4:]
else:
    from dsparkctl.cli.main import app
    code, sys.argv = "app()", ["dsparkctl", *sys.argv[3:]]
for name in ("replace", "rename", "unlink", "fsync", "mkdir", "rmdir", "ftruncate"):
    counted(name)
try:
    exec(code)
finally:
    open(LOG, "w").write(str(n[0]))
'''


def _run(k: int, *argv: str, cwd: Path) -> tuple[int, int]:
    """Run `dsparkctl argv` (or `-c CODE`) killed at counted call k (0: never); (returncode, calls)."""
    log = cwd / "calls.txt"
    log.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", KILLER, str(k), str(log), *argv], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=300)
    calls = int(log.read_text()) if log.exists() else -1
    assert p.returncode in (0, -signal.SIGKILL), p.stderr
    return p.returncode, calls


def _points(total: int, commit_from: int, seed: int, sample: int = 6) -> list[int]:
    """Every call from `commit_from` on, and a random sample before it."""
    rng = random.Random(seed)
    early = rng.sample(range(1, commit_from), min(sample, commit_from - 1))
    return sorted(early) + list(range(commit_from, total + 1))


def _hidden_leftovers(*folders: Path) -> list[str]:
    return [p.name for f in folders if f.exists() for p in f.iterdir()
            if p.name.startswith(".")]


# -------- calibrate: JSON + SGLang STS file + one PNG per position, across two folders
@pytest.mark.slow  # ~30 runs of the command, each killed at another step
def test_calibrate_killed_at_every_step_leaves_old_or_new(tmp_path):
    inputs = {}
    for name, seed in (("a", 1), ("b", 2)):
        write_synthetic_trace(tmp_path / f"{name}.jsonl", SyntheticModel(), 40, 10, seed=seed)
    out = tmp_path / "out"
    files = [out / "calib.json", out / "calib.sglang-sts.json",
             *[out / "calib_reliability" / f"reliability_pos{k}.png" for k in range(1, 6)]]

    def state() -> tuple[str, dict[str, bytes]]:
        doc = json.loads(files[0].read_text())
        sts = json.loads(files[1].read_text())
        assert sts["temperatures"] == pytest.approx(doc["temperatures"]), "the JSON and the STS file disagree"
        for png in files[2:]:
            data = png.read_bytes()
            assert data.startswith(b"\x89PNG") and data.endswith(b"IEND\xaeB`\x82"), png
        which = [k for k, t in inputs.items() if t == doc["temperatures"]]
        assert len(which) == 1
        return which[0], {str(f): f.read_bytes() for f in files}

    for name in ("a", "b"):  # complete runs: each input's temperatures, and the second replaces the first
        rc, total = _run(0, "calibrate", f"{name}.jsonl", "--out", "out/calib.json", cwd=tmp_path)
        inputs[name] = json.loads(files[0].read_text())["temperatures"]
    assert inputs["a"] != inputs["b"]
    current, before = state()
    first_commit_call = total - 22  # the commit: ledger, journal, 7 renames, ledger, cleanup (counted below)
    hits = 0
    for k in _points(total, first_commit_call, seed=0, sample=3):
        nxt = "a" if current == "b" else "b"
        rc, _ = _run(k, "calibrate", f"{nxt}.jsonl", "--out", "out/calib.json", cwd=tmp_path)
        hits += rc == -signal.SIGKILL
        commit.recover(out)
        commit.recover(out / "calib_reliability")
        now, after = state()
        changed = [f for f in files if after[str(f)] != before[str(f)]]
        assert changed in ([], files), f"killed at call {k}: only {len(changed)} of {len(files)} outputs changed"
        assert (now == nxt) == bool(changed)
        assert _hidden_leftovers(out, out / "calib_reliability") == [], k
        current, before = now, after
    assert hits >= 18
    rc, _ = _run(0, "calibrate", "a.jsonl", "--out", "out/calib.json", cwd=tmp_path)  # no cleanup needed
    assert rc == 0 and state()[0] == "a"


# -------- a draft folder replaced in place (serve-config's exports, train --out)
SWAP = '''
import sys
import time
from dsparkctl.files import commit
from dsparkctl.models.draft_io import random_draft, save_draft
from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import tiny_target
commit.set_command("serve-config")
adapter = TargetAdapter(tiny_target("llama", vocab=64, layers=4))
save_draft(random_draft(adapter, seed=int(sys.argv[1]), num_layers=1, block_size=4), "draft", overwrite=True,
           extra_config={"which": sys.argv[1]})
'''


@pytest.mark.slow  # ~25 runs, each killed at another step
def test_draft_swap_killed_at_every_step_leaves_a_whole_draft(tmp_path):
    from safetensors.torch import load_file

    def which() -> str:
        cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
        load_file(str(tmp_path / "draft" / "model.safetensors"))  # whole
        return cfg["which"]

    rc, total = _run(0, "-c", SWAP, "1", cwd=tmp_path)
    assert rc == 0 and which() == "1"
    rc, total = _run(0, "-c", SWAP, "2", cwd=tmp_path)  # replaces the draft it wrote
    assert rc == 0 and which() == "2"
    hits = 0
    for k in _points(total, max(1, total - 14), seed=1, sample=2):
        before = which()
        nxt = "1" if before == "2" else "2"
        rc, _ = _run(k, "-c", SWAP, nxt, cwd=tmp_path)
        hits += rc == -signal.SIGKILL
        commit.recover(tmp_path)
        assert which() in (before, nxt), k
        assert _hidden_leftovers(tmp_path) == [], k
    assert hits >= 8
    rc, _ = _run(0, "-c", SWAP, "3", cwd=tmp_path)
    assert rc == 0 and which() == "3"


# -------- N identical commands at once on one output
def test_identical_commands_at_once_give_one_whole_result(tmp_path):
    write_synthetic_trace(tmp_path / "t.jsonl", SyntheticModel(), 30, 10, seed=3)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "dsparkctl", "calibrate", "t.jsonl", "--out", "out/c.json", "--json"]

    def one(_: int) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(one, range(4)))
    assert [r.returncode for r in runs] == [0] * 4, [r.stderr for r in runs]
    doc = json.loads((tmp_path / "out" / "c.json").read_text())
    sts = json.loads((tmp_path / "out" / "c.sglang-sts.json").read_text())
    assert sts["temperatures"] == pytest.approx(doc["temperatures"])
    assert all(json.loads(r.stdout)["temperatures"] == doc["temperatures"] for r in runs)
    assert _hidden_leftovers(tmp_path / "out", tmp_path / "out" / "c_reliability") == []


# -------- a resumed train logs each step once
def test_a_resumed_log_keeps_the_steps_up_to_its_checkpoint(tmp_path):
    from dsparkctl.files.atomic import cut_log

    log = tmp_path / "log.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 8)]
    log.write_text("\n".join(rows) + "\n" + '{"step": 8, "lo')  # steps 6, 7 redone after step 5; 8 torn
    cut_log(log, 5)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5]
    cut_log(tmp_path / "absent.jsonl", 5)  # nothing to cut
    assert not (tmp_path / "absent.jsonl").exists()


# -------- one command's draft is not another's to replace
def test_serve_config_does_not_replace_a_draft_train_wrote(tmp_path):
    from dsparkctl.errors import InputError
    from dsparkctl.models.draft_io import check_draft_destination, random_draft, save_draft
    from dsparkctl.models.target import TargetAdapter
    from tests.tiny_models import tiny_target

    draft = random_draft(TargetAdapter(tiny_target("llama", vocab=64, layers=4)), num_layers=1, block_size=4)
    try:
        commit.set_command("train")
        save_draft(draft, tmp_path / "d")
        assert check_draft_destination(tmp_path / "d", overwrite=True) == tmp_path / "d"  # train's own: replaceable
        commit.set_command("serve-config")
        with pytest.raises(InputError, match="was written by `dsparkctl train`, not by this command"):
            check_draft_destination(tmp_path / "d", overwrite=True)
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "config.json").write_text('{"dsparkctl": {"tool": "dsparkctl"}}')  # looks like ours
        with pytest.raises(InputError, match="no record of writing it"):
            check_draft_destination(tmp_path / "mine", overwrite=True)
    finally:
        commit.set_command(None)


# -------- N identical commands at once on the shared caches (kernel choices, step costs) and one output
@pytest.mark.slow  # three generate runs at once, each profiling a fresh machine table (~1 min)
def test_identical_generates_at_once_share_caches_and_one_trace(tmp_path):
    from tests.tiny_models import save_tiny_target, write_deepspec_draft

    target = save_tiny_target(tmp_path / "target", "qwen3", vocab=64, layers=4)
    draft = write_deepspec_draft(tmp_path / "draft", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4)
    caches = tmp_path / "caches"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "DSPARKCTL_CPU_KERNELS_CACHE": str(caches / "kernels.json"), "DSPARKCTL_SPS_CACHE": str(caches / "sps"),
           "DSPARKCTL_CONTINUATIONS_CACHE": str(caches / "continuations")}
    argv = [sys.executable, "-m", "dsparkctl", "generate", "--target", str(target), "--draft", str(draft),
            "--no-chat", "--max-new-tokens", "8", "--policy", "dspark", "--trace", "out/t.jsonl", "--json",
            "w1 w2 w3", "w4 w5"]

    def one(_: int) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(3) as pool:
        runs = list(pool.map(one, range(3)))
    assert [r.returncode for r in runs] == [0] * 3, [  # what each said, without the profiling's progress lines
        [ln for ln in r.stderr.splitlines() if "step costs" not in ln][-8:] + [r.stdout[-300:]] for r in runs]
    texts = {tuple(q["text"] for q in json.loads(r.stdout)["requests"]) for r in runs}
    assert len(texts) == 1  # greedy: one answer, whichever run measured the caches
    lines = (tmp_path / "out" / "t.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["block_size"] == 4 and all(json.loads(line) for line in lines)  # one whole trace
    for f in [caches / "kernels.json", *(caches / "sps").glob("*.json")]:
        json.loads(f.read_text())  # every cache entry whole
    assert not [p for p in (caches / "sps").iterdir() if p.name.startswith(".")]
    assert _hidden_leftovers(tmp_path / "out", caches) == []


# -------- a rerun's set of outputs replaces the earlier set, a wait for a folder's lock is bounded
def test_a_smaller_rerun_removes_the_figures_it_no_longer_draws(tmp_path):
    from typer.testing import CliRunner

    from dsparkctl.cli.main import app

    write_synthetic_trace(tmp_path / "g5.jsonl", SyntheticModel(), 30, 8, seed=1)
    g3 = SyntheticModel(gamma=3, mean_logit=(2.0, 1.5, 1.0), overconfidence=(2.0,) * 3, bias=(0.0,) * 3)
    write_synthetic_trace(tmp_path / "g3.jsonl", g3, 30, 8, seed=2)
    plots = tmp_path / "c_reliability"
    for trace in ("g5.jsonl", "g3.jsonl"):
        r = CliRunner().invoke(app, ["calibrate", str(tmp_path / trace), "--out", str(tmp_path / "c.json")])
        assert r.exit_code == 0, r.output
        if trace == "g5.jsonl":
            (plots / "my_notes.png").write_bytes(b"mine")  # the user's file in that folder stays
    assert sorted(p.name for p in plots.iterdir()) == ["my_notes.png"] + [f"reliability_pos{k}.png" for k in (1, 2, 3)]


def test_a_wait_for_a_folder_held_by_a_stopped_commit_is_said_and_bounded(tmp_path, capsys):
    import fcntl

    from dsparkctl.errors import InputError
    from dsparkctl.files.ledger import folder_lock

    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(30)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(InputError, match="has held the lock of .* stopped or hung"):
            with folder_lock(tmp_path, limit_s=1.5):
                pass
        assert "waiting for another process that is committing its outputs" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    with folder_lock(tmp_path, limit_s=1.5):  # free again: taken at once
        fd = os.open(tmp_path, os.O_RDONLY)
        with pytest.raises(BlockingIOError):  # and held by us now
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)


# -------- a signal during an import waits for the import (an interrupted extension init aborts Python)
def test_a_signal_during_an_import_is_taken_after_it(tmp_path):
    (tmp_path / "slowmod.py").write_text("import time\nfor _ in range(40):\n    time.sleep(0.01)\nX = 1\n")
    code = ("import sys, time\nfrom dsparkctl.signals import terminate_as_interrupt\n"
            "try:\n    with terminate_as_interrupt():\n        print('ready', flush=True)\n        import slowmod\n"
            "        print('imported', slowmod.X, flush=True)\n        time.sleep(10)\n"
            "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n    sys.exit(130)\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.1)  # inside the import now
    p.send_signal(signal.SIGTERM)
    assert p.stdout.read().split() == ["imported", "1", "interrupted"] and p.wait(30) == 130


# -------- sweep-scheduler: its JSON and its figure
@pytest.mark.slow  # ~20 runs of the command, each killed at another step
def test_sweep_killed_at_every_step_of_its_commit_leaves_old_or_new(tmp_path):
    from dsparkctl.formats.sps import save_sps_table
    from dsparkctl.math.sps import SPSTable

    for name, seed in (("a", 1), ("b", 2)):
        write_synthetic_trace(tmp_path / f"{name}.jsonl", SyntheticModel(), 30, 8, seed=seed)
    save_sps_table(SPSTable([1, 4, 16, 64], [50.0, 40.0, 35.0, 25.0]), tmp_path / "sps.json")
    out = tmp_path / "out"
    files = [out / "s.json", out / "s.png"]

    def argv(name: str) -> list[str]:
        return ["sweep-scheduler", "--trace", f"{name}.jsonl", "--sps-table", "sps.json", "--policies", "static:1",
                "--concurrency", "1,4", "--rounds", "200", "--out", "out/s.json", "--plot", "out/s.png"]

    def state() -> str:
        doc = json.loads(files[0].read_text())
        assert files[1].read_bytes().endswith(b"IEND\xaeB`\x82")
        return Path(doc["acceptance_source"]["files"][0]).stem

    for name in ("a", "b"):
        rc, total = _run(0, *argv(name), cwd=tmp_path)
        assert rc == 0
    current, before = state(), {f: f.read_bytes() for f in files}
    for k in _points(total, max(1, total - 14), seed=2, sample=2):
        nxt = "a" if current == "b" else "b"
        _run(k, *argv(nxt), cwd=tmp_path)
        commit.recover(out)
        now, after = state(), {f: f.read_bytes() for f in files}
        changed = [f for f in files if after[f] != before[f]]
        assert changed in ([], files), f"killed at call {k}: only {changed} changed"
        assert (now == nxt) == bool(changed)
        assert _hidden_leftovers(out) == [], k
        current, before = now, after


# -------- the recovery rules, case by case (a second round of unseen tries)
THREE = '''
import sys
from dsparkctl.files import commit
from dsparkctl.files.atomic import write_json
commit.set_command("calibrate")
with commit.transaction() as tx:
    for name in ("a.json", "b.json", "c\\nd.json"):
        write_json(tx.file(name), {"run": sys.argv[1]})
'''


def _set(folder: Path) -> set:
    return {json.loads((folder / n).read_text())["run"] if (folder / n).exists() else None
            for n in ("a.json", "b.json", "c\nd.json")}


def test_a_first_run_killed_anywhere_in_its_commit_leaves_none_or_all_and_a_rerun_works(tmp_path):
    (tmp_path / "probe").mkdir()
    _, total = _run(0, "-c", THREE, "probe", cwd=tmp_path / "probe")
    commit.set_command("calibrate")
    try:
        for k in range(1, total + 1):  # every call
            work = tmp_path / f"k{k}"
            work.mkdir()
            _run(k, "-c", THREE, "first", cwd=work)
            (work / "calls.txt").unlink(missing_ok=True)
            commit.recover(work)
            assert _set(work) in ({None}, {"first"}), k  # nothing, or the whole set
            assert _hidden_leftovers(work) == [], (k, _hidden_leftovers(work))  # the newline name too
            rc, _ = _run(0, "-c", THREE, "second", cwd=work)  # replaces what the first run committed
            assert rc == 0 and _set(work) == {"second"}, k
    finally:
        commit.set_command(None)


def test_a_finished_commit_never_replaces_what_a_user_put_there_after_the_crash(tmp_path):
    (tmp_path / "probe").mkdir()
    _, total = _run(0, "-c", THREE, "probe", cwd=tmp_path / "probe")
    journal_at = None
    for k in range(max(1, total - 20), total + 1):  # the first call after the commit point: the journal is in place
        work = tmp_path / f"w{k}"
        work.mkdir()
        _run(0, "-c", THREE, "old", cwd=work)
        _run(k, "-c", THREE, "new", cwd=work)
        if any(p.name.startswith(".dsparkctl-commit.") and p.name.endswith(".json") for p in work.iterdir()):
            journal_at = work
            break
    assert journal_at is not None
    (journal_at / "a.json").unlink(missing_ok=True)
    (journal_at / "a.json").write_text('{"run": "the user\'s"}')  # put there by hand after the crash
    commit.recover(journal_at)
    assert json.loads((journal_at / "a.json").read_text())["run"] == "the user's"
    assert _hidden_leftovers(journal_at) == []


def test_damaged_records_are_never_an_error_nor_a_licence(tmp_path):
    from dsparkctl.files.ledger import FORMAT, ledger_path
    from dsparkctl.files.ownership import inside_another_output, replace_refusal

    (tmp_path / "sub").mkdir()
    (tmp_path / "x.json").write_text("{}")
    ledger_path(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    ledger_path(tmp_path).write_text(json.dumps({"format": FORMAT, "folder": os.path.realpath(tmp_path), "entries": {
        "sub": {"command": "serve-config", "fp": [5, {"a": 1}, "folder"]},
        "x.json": {"command": "library", "fp": [[1], None]}}}))
    assert inside_another_output(tmp_path / "sub" / "c.json") is None
    assert "no record" in replace_refusal(tmp_path / "x.json")
    # a lock naming a damaged journal: the dead run never committed, its leftovers go
    run = "a" * 12
    (tmp_path / f".dsparkctl-commit.{run}.json").write_text('{"ops": [garbage')
    (tmp_path / f".dsparkctl-run.{run}.lock").write_text(json.dumps(
        {"tool": "dsparkctl", "journal": str(tmp_path / f".dsparkctl-commit.{run}.json")}))
    (tmp_path / f".c.json.{run}-3.new").write_text("{}")
    commit.recover(tmp_path)
    assert _hidden_leftovers(tmp_path) == []


def test_a_symlinked_path_reaches_the_same_record(tmp_path):
    from dsparkctl.files.atomic import atomic_dir
    from dsparkctl.files.ownership import inside_another_output

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    commit.set_command("serve-config")
    try:
        with atomic_dir(tmp_path / "real" / "full") as tmp:
            (tmp / "config.json").write_text("{}")
    finally:
        commit.set_command(None)
    assert "output folder" in inside_another_output(tmp_path / "link" / "full", as_folder=True)
    assert "inside the output folder" in inside_another_output(tmp_path / "link" / "full" / "c.json")


def test_prune_is_decided_at_the_commit(tmp_path):
    from dsparkctl.files.atomic import write_json

    for k in (1, 2, 3, 4, 5):
        write_json(tmp_path / f"p{k}.png", {})
    with commit.transaction() as tx:
        for k in (1, 2):
            write_json(tx.file(tmp_path / f"p{k}.png"), {"new": True})
        tx.prune(tmp_path, r"p[0-9]+\.png")
        write_json(tmp_path / "p6.png", {}, each_rank=True)  # another run's, committed before ours: ours prunes it
        (tmp_path / "p7.png").write_text("the user's")  # never ours: stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p1.png", "p2.png", "p7.png"]
