"""`train` checks what it can before any data is built (issue 20, class 5): an init_from draft of
another target, a damaged run folder on --resume, a run folder in use by a live process; each is
one line, exit 2, and the data cache stays empty."""

from __future__ import annotations

import json
import os
import socket

import pytest
from typer.testing import CliRunner

from dsparkctl import locks
from dsparkctl.cli import console
from dsparkctl.cli.main import app
from tests.helpers import tiny_recipe, write_tiny_prompts
from tests.tiny_models import save_tiny_target, write_deepspec_draft


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainchecks")
    target = save_tiny_target(d / "target", "llama")
    write_tiny_prompts(d / "p.txt")
    write_deepspec_draft(d / "other-vocab", vocab=80, taps=(0, 2), block_size=3)
    write_deepspec_draft(d / "other-width", hidden=48, taps=(0, 2), block_size=3)
    return d, target


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


def _recipe(base, tmp_path, init=""):
    d, target = base
    r = tmp_path / "r.toml"
    r.write_text(tiny_recipe(target, d / "p.txt", optim={"init_from": str(init)}))
    return r


@pytest.mark.parametrize("init,message", [
    ("other-vocab", "draft vocabulary 80 != target vocabulary 64"),
    ("other-width", "draft hidden size 48 != target hidden size 32"),
])
def test_init_from_another_target_is_refused_before_the_data(base, tmp_path, init, message):
    r = _recipe(base, tmp_path, str(base[0] / init))
    res = CliRunner().invoke(app, ["train", str(r), "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code in (2, 3) and message in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not list((tmp_path / "cache").glob("data-*"))


def test_a_damaged_run_is_refused_before_the_data_and_a_busy_one_at_once(base, tmp_path):
    r = _recipe(base, tmp_path)
    cache = tmp_path / "cache"
    args = ["train", str(r), "--cache-dir", str(cache), "--json"]
    assert CliRunner().invoke(app, args + ["--max-steps", "1"]).exit_code == 0
    (run,) = (cache / "runs").iterdir()
    (run / "latest.json").write_text("[1]")
    data = sorted(p.name for p in (cache / next(p.name for p in cache.iterdir() if p.name.startswith("data-"))).iterdir())
    res = CliRunner().invoke(app, args + ["--resume"])
    assert res.exit_code == 2 and f"{run}/latest.json: is not {{" in res.output and "the run folder is damaged" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    (run / "latest.json").write_text(json.dumps({"step": 1, "path": "step_000001"}))
    (run / "run.lock").write_text(json.dumps({**locks.me(), "pid": os.getppid(),
                                               "start": locks._start_ticks(os.getppid())}))
    res = CliRunner().invoke(app, args + ["--resume"])
    assert res.exit_code == 2 and f"the run folder {run} is in use by process {os.getppid()} on {socket.gethostname()}" \
        in res.output, res.output
    assert sorted(p.name for p in (cache / next(p.name for p in cache.iterdir() if p.name.startswith("data-"))).iterdir()) == data
