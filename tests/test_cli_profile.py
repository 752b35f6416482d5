"""Hostile inputs to `profile-sps` (issue 12): each case exits non-zero with one line naming the
option, no traceback, nothing written, and before any expensive work (the output cases name a
target that does not exist: had the model been loaded first, that would be the error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsparkctl.cli import console
from dsparkctl.cli.main import app
from dsparkctl.strict_json import loads
from tests.helpers import snapshot
from tests.tiny_models import save_tiny_target

runner = CliRunner()
FAST = ["--requests", "1", "--tokens-per-request", "1,2", "--repeats", "1", "--warmup", "0", "--context-len", "8"]


@pytest.fixture(autouse=True)
def _one_line(monkeypatch):
    monkeypatch.setattr(console.err, "soft_wrap", True)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tiny Llama with 2048 positions (LlamaConfig's default max_position_embeddings)."""
    folder = save_tiny_target(tmp_path_factory.mktemp("target") / "llama", "llama", vocab=64, layers=2)
    assert json.loads((folder / "config.json").read_text())["max_position_embeddings"] == 2048
    return folder


NO_MODEL = ["profile-sps", "--target", "{o}/no-such-model", *FAST]
MODEL = ["profile-sps", "--target", "{t}", "--out", "{o}/sps.json"]

# (case, argv with {o} = the user's folder and {t} = the tiny target, text of the one line)
CASES = [
    ("--plot j.xyz", [*NO_MODEL, "--out", "{o}/j.json", "--plot", "{o}/j.xyz"], "cannot write figures of type '.xyz'"),
    ("--plot j.PNGX", [*NO_MODEL, "--out", "{o}/j.json", "--plot", "{o}/j.PNGX"], "type '.PNGX'"),
    ("--out a folder", [*NO_MODEL, "--out", "{o}/sub"], "--out {o}/sub is a folder"),
    ("--sglang-out a folder", [*NO_MODEL, "--out", "{o}/j.json", "--sglang-out", "{o}/sub"],
     "--sglang-out {o}/sub is a folder"),
    ("--plot a folder", [*NO_MODEL, "--out", "{o}/j.json", "--plot", "{o}/sub"], "--plot {o}/sub is a folder"),
    ("--out below a file", [*NO_MODEL, "--out", "{o}/notes.txt/j.json"], "{o}/notes.txt is not a folder"),
    ("--out x.png = default --plot", [*NO_MODEL, "--out", "{o}/x.png"], "--plot {o}/x.png is the same path as --out"),
    ("--sglang-out = --out", [*NO_MODEL, "--out", "{o}/j.json", "--sglang-out", "{o}/j.json"], "is the same path"),
    ("--out empty", [*NO_MODEL, "--out", ""], "--out is empty"),
    ("--context-len 0", [*NO_MODEL, "--context-len", "0"], "--context-len"),
    ("--repeats 0", [*NO_MODEL, "--repeats", "0"], "--repeats"),
    ("--repeats huge", [*NO_MODEL, "--repeats", "99999999999"], "--repeats and --warmup must be at most 1000"),
    ("--warmup -1", [*NO_MODEL, "--warmup", "-1"], "--warmup"),
    ("--requests ''", [*NO_MODEL, "--requests", ""], "--requests must be positive integers"),
    ("--requests 0", [*NO_MODEL, "--requests", "0,1"], "--requests must be positive integers"),
    ("--requests a", [*NO_MODEL, "--requests", "a"], "--requests must be comma-separated integers"),
    ("--tokens-per-request -2", [*NO_MODEL, "--tokens-per-request", "1,-2"], "--tokens-per-request"),
    ("--seed 2**70", [*NO_MODEL, "--seed", str(2 ** 70)], "--seed"),
    # bounded by the model: refused after loading it, before any forward
    ("--context-len beyond positions", [*MODEL, "--context-len", "100000", "--requests", "1", "--measure",
                                        "target-forward"],
     "--context-len 100000 + 8 tokens per request = 100008 positions, beyond the model's 2048"),
    ("--context-len at the edge", [*MODEL, "--context-len", "2047", "--tokens-per-request", "1,2"],
     "+ 2 tokens per request + 2 committed first = 2051 positions, beyond the model's 2048"),
]


@pytest.mark.parametrize("case,argv,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, argv, needle, target: Path, tmp_path: Path, monkeypatch):
    o = tmp_path / "mine"
    (o / "sub").mkdir(parents=True)
    (o / "notes.txt").write_text("the user's")
    monkeypatch.chdir(o)  # the default --out sps.json would land here
    before = snapshot(o)
    res = runner.invoke(app, [a.format(o=o, t=target) for a in argv])
    message = res.stderr.strip().splitlines()
    assert res.exit_code not in (0, None), f"{case}: exit 0"
    errors = [m for m in message if m.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.output, message  # (loading the model logs a line)
    assert needle.format(o=o) in errors[0], f"{case}: {needle!r} not in {errors[0]!r}"
    assert snapshot(o) == before, f"{case}: files left or changed"


def test_all_three_outputs_and_strict_json(target: Path, tmp_path: Path):
    res = runner.invoke(app, ["profile-sps", "--target", str(target), "--out", str(tmp_path / "p.json"),
                              "--plot", str(tmp_path / "p.svg"), *FAST, "--json"])
    assert res.exit_code == 0, res.output
    doc = loads(res.stdout)
    assert doc["batch_tokens"] == [1, 2] and all(s > 0 for s in doc["steps_per_sec"])
    for f in ("p.json", "p.sglang.json"):
        loads((tmp_path / f).read_bytes())
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")
