"""A run folder is untrusted input (issue 20, class 3): `trainer.read_latest` and
`read_checkpoint` validate latest.json, state.pt (weights_only) and draft.safetensors like user
input; a damaged run is refused at load, in one line naming the file, and the trainer is left as
it was. A stray folder under checkpoints/ is left alone (never an error at the next save)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsparkctl.errors import InputError
from dsparkctl.models.target import TargetAdapter
from dsparkctl.train.draft_init import init_draft
from dsparkctl.train.recipe import load_recipe
from dsparkctl.train.trainer import Trainer
from tests.helpers import regenerated_tiny


@pytest.fixture(scope="module")
def tiny():
    model, _, seqs = regenerated_tiny()
    return model, seqs


def _trainer(model, seqs, run_dir, extra=()):
    rec = load_recipe(None, ["num_layers=1", "layer_ids=[0, 2]", "block_size=3", "markov_rank=8",
                             "mask_token_id=2", "steps=6", "checkpoint_every=3", "batch_sequences=2",
                             "anchors_per_sequence=4", "warmup_steps=2", "optim.threads=0", "holdout=1",
                             "num_prompts=4", *extra])
    return Trainer(rec, init_draft(rec, TargetAdapter(model), 2), seqs, run_dir)


def _state(run):
    return run / "checkpoints" / "step_000003" / "state.pt"


def _draft(run):
    return run / "checkpoints" / "step_000003" / "draft.safetensors"


def _edit_state(run, fn):
    st = torch.load(_state(run), weights_only=True)
    fn(st)
    torch.save(st, _state(run))


def _edit_draft(run, fn):
    t = load_file(str(_draft(run)))
    fn(t)
    save_file(t, str(_draft(run)))


DAMAGE = [
    ("latest truncated", lambda r: (r / "latest.json").write_text('{"step": 3, "pa'), "latest.json", "not valid JSON"),
    ("latest a list", lambda r: (r / "latest.json").write_text("[3]"), "latest.json", "is not {"),
    ("latest without path", lambda r: (r / "latest.json").write_text('{"step": 3}'), "latest.json", "is not {"),
    ("latest leads outside", lambda r: (r / "latest.json").write_text('{"step": 3, "path": "../../etc"}'),
     "latest.json", "do not agree"),
    ("latest absolute path", lambda r: (r / "latest.json").write_text('{"step": 3, "path": "/tmp"}'),
     "latest.json", "do not agree"),
    ("latest other step", lambda r: (r / "latest.json").write_text('{"step": 6, "path": "step_000003"}'),
     "latest.json", "do not agree"),
    ("latest bool step", lambda r: (r / "latest.json").write_text('{"step": true, "path": "step_000001"}'),
     "latest.json", "do not agree"),
    ("latest names a missing step", lambda r: (r / "latest.json").write_text('{"step": 9, "path": "step_000009"}'),
     "latest.json", "missing or not a folder"),
    ("latest a folder", lambda r: ((r / "latest.json").unlink(), (r / "latest.json").mkdir()), "latest.json",
     "not a regular file"),
    ("state truncated", lambda r: _state(r).write_bytes(_state(r).read_bytes()[:100]), "state.pt", "cannot be read"),
    ("state missing", lambda r: _state(r).unlink(), "state.pt", "missing"),
    ("state a pickle", lambda r: _state(r).write_bytes(b"\x80\x04K\x01."), "state.pt", "cannot be read"),
    ("state a list", lambda r: torch.save([1], _state(r)), "state.pt", "not a checkpoint state"),
    ("state other step", lambda r: _edit_state(r, lambda s: s.update(step=4)), "state.pt", "is of step 4"),
    ("state bad generator", lambda r: _edit_state(r, lambda s: s.update(generator=torch.zeros(3, dtype=torch.uint8))),
     "state.pt", "generator"),
    ("state wrong moment shape", lambda r: _edit_state(r, lambda s: s["optimizer"]["state"][0].update(
        exp_avg=torch.zeros(2))), "state.pt", "exp_avg of parameter 0"),
    ("state NaN moment", lambda r: _edit_state(r, lambda s: s["optimizer"]["state"][0]["exp_avg_sq"].fill_(
        float("nan"))), "state.pt", "exp_avg_sq of parameter 0"),
    ("state other param groups", lambda r: _edit_state(r, lambda s: s["optimizer"].update(param_groups=[])),
     "state.pt", "optimizer state"),
    ("draft truncated", lambda r: _draft(r).write_bytes(_draft(r).read_bytes()[:200]), "draft.safetensors",
     "cannot be read"),
    ("draft missing", lambda r: _draft(r).unlink(), "draft.safetensors", "missing"),
    ("draft wrong shape", lambda r: _edit_draft(r, lambda t: t.update({"fc.weight": torch.zeros(2, 2)})),
     "draft.safetensors", "tensor fc.weight is (2, 2)"),
    ("draft extra tensor", lambda r: _edit_draft(r, lambda t: t.update({"x": torch.zeros(1)})), "draft.safetensors",
     "other tensors"),
    ("draft NaN", lambda r: _edit_draft(r, lambda t: t["fc.weight"].fill_(float("nan"))), "draft.safetensors",
     "NaN"),
]


@pytest.mark.parametrize("case,damage,file,why", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_run_is_refused_in_one_line_naming_the_file(tiny, tmp_path, case, damage, file, why):
    model, seqs = tiny
    run = tmp_path / "run"
    _trainer(model, seqs, run).train(stop_after=3)
    damage(run)
    fresh = _trainer(model, seqs, run)
    before = {n: p.detach().clone() for n, p in fresh.draft.named_parameters()}
    with pytest.raises(InputError) as e:
        fresh.load_latest()
    line = e.value.one_line()
    assert "\n" not in line and file in line and why in line and "the run folder is damaged" in line, line
    assert f"delete {run}" in line
    assert fresh.step == 0 and all(torch.equal(p, before[n]) for n, p in fresh.draft.named_parameters())


def test_a_stray_checkpoint_folder_is_left_alone(tiny, tmp_path):
    model, seqs = tiny
    run = tmp_path / "run"
    (run / "checkpoints" / "step_old").mkdir(parents=True)
    (run / "checkpoints" / "step_12").mkdir()
    tr = _trainer(model, seqs, run)
    tr.train()  # saves at 3 and 6: the stray folders never break the clean-up
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000006", "step_12", "step_old"]
    again = _trainer(model, seqs, run)
    assert again.load_latest() == 6 and json.loads((run / "latest.json").read_text())["path"] == "step_000006"


@pytest.mark.parametrize("name,make,why", [
    ("log.jsonl", "fifo", "is not a regular file"), ("evals.jsonl", "symlink", "is not a regular file"),
    ("latest.json", "folder", "is not a regular file"), ("checkpoints", "file", "is not a folder"),
    ("final", "symlink", "is not a folder"), ("log.jsonl", "file", None)])
def test_run_files_that_a_writer_would_block_on_or_follow_are_refused(tmp_path, name, make, why):
    import os

    from dsparkctl.train.checkpoints import check_run_files

    p = tmp_path / name
    {"fifo": lambda: os.mkfifo(p), "symlink": lambda: p.symlink_to(tmp_path.parent), "folder": p.mkdir,
     "file": lambda: p.write_text("{}\n")}[make]()
    if why is None:
        check_run_files(tmp_path)
        return
    with pytest.raises(InputError) as e:
        check_run_files(tmp_path)
    assert f"{p}: {why}; the run folder is damaged" in e.value.one_line()
