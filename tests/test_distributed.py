"""torchrun with 2 gloo ranks on the CPU: merged results equal one process's; failures end the job.

Each test launches real processes (`python -m torch.distributed.run --standalone`), so they are
the slowest in the suite (~10-20 s each); the models are tiny."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import tiny_recipe
from tests.tiny_models import save_tiny_target, write_deepspec_draft

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # two torchrun ranks: real processes, 10-30 s a test


def run(args: list[str], ranks: int = 1, timeout: int = 240, script: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    entry = [str(script)] if script else ["-m", "dsparkctl"]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "--monitor-interval=0.5", *(entry if script else ["-m", "dsparkctl"]), *args]
    else:
        cmd = [sys.executable, *entry, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    target = save_tiny_target(d / "target", "llama")
    draft = write_deepspec_draft(d / "draft", block_size=3)
    prompts = d / "p.txt"
    prompts.write_text("\n".join(f"w{i} w{i + 1} w{i + 2} w{i + 3}" for i in range(3, 50, 4)) + "\n")  # 12 prompts
    return {"target": target, "draft": draft, "prompts": prompts, "dir": d}


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_generate_two_ranks_equals_one(models, temperature):
    args = ["generate", "--target", str(models["target"]), "--draft", str(models["draft"]), "--prompts-file",
            str(models["prompts"]), "--batch-size", "2", "--max-new-tokens", "12", "--temperature", temperature,
            "--json", "--no-text"]
    one = run(args + ["--trace", str(models["dir"] / f"t1-{temperature}.jsonl")])
    two = run(args + ["--trace", str(models["dir"] / f"t2-{temperature}.jsonl")], ranks=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout)  # rank 1 prints nothing: one JSON document
    assert [r["text"] for r in a["requests"]] == [r["text"] for r in b["requests"]]
    assert a["acceptance"]["histogram"] == b["acceptance"]["histogram"]
    assert a["acceptance"]["reached"] == b["acceptance"]["reached"]
    t1 = (models["dir"] / f"t1-{temperature}.jsonl").read_text().splitlines()[1:]
    t2 = (models["dir"] / f"t2-{temperature}.jsonl").read_text().splitlines()[1:]
    def rows(lines):  # timings and the batch's token count differ with the split; the rounds do not
        keep = [{k: v for k, v in json.loads(x).items() if not k.endswith("_ms")} for x in lines]
        return sorted(keep, key=lambda r: (r["request"], r["round"]))
    assert rows(t1) == rows(t2)


def test_eval_acceptance_two_ranks_equals_one(models):
    args = ["eval-acceptance", "--target", str(models["target"]), "--draft", str(models["draft"]), "--dataset",
            str(models["prompts"]), "--batch-size", "2", "--max-new-tokens", "10", "--json"]
    one, two = run(args), run(args, ranks=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    a = json.loads(one.stdout)["datasets"][str(models["prompts"])]["drafts"]
    b = json.loads(two.stdout)["datasets"][str(models["prompts"])]["drafts"]
    for label in a:
        for mode in ("live", "teacher_forced"):
            for key in ("tau", "conditional", "survival"):
                assert a[label][mode][key] == pytest.approx(b[label][mode][key], abs=1e-9), (mode, key)
        assert a[label]["live"]["histogram"] == b[label]["live"]["histogram"]


def test_train_two_ranks_times_b_equals_one_rank_times_2b(models):
    recipe = models["dir"] / "r.toml"
    recipe.write_text(tiny_recipe(models["target"], models["prompts"], name="dist",
                                  data={"num_prompts": 12, "max_new_tokens": 16, "batch_size": 3, "temperature": 1.0},
                                  optim={"steps": 6, "checkpoint_every": 6, "batch_sequences": 4,
                                         "anchors_per_sequence": 4}))
    c1, c2 = models["dir"] / "c1", models["dir"] / "c2"
    one = run(["train", str(recipe), "--cache-dir", str(c1), "--json"])
    two = run(["train", str(recipe), "--cache-dir", str(c2), "--json"], ranks=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    a = load_file(str(next(c1.glob("runs/*/checkpoints/step_000006/draft.safetensors"))))
    b = load_file(str(next(c2.glob("runs/*/checkpoints/step_000006/draft.safetensors"))))
    assert set(a) == set(b)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"largest parameter difference after 6 steps: {worst:.2e}")
    assert worst < 1e-5  # float summation order only
    # data parts were built once, split across the ranks, and are identical to the one-process parts
    for f in sorted(c1.glob("data-*/tokens_*.safetensors")):
        g = c2 / f.parent.name / f.name
        assert torch.equal(load_file(str(f))["tokens"], load_file(str(g))["tokens"])


def test_a_failing_rank_ends_the_job_with_its_message(models, tmp_path):
    script = tmp_path / "fail_rank1.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from dsparkctl.engine import speculative\n"
        "from dsparkctl.errors import InputError\n"
        "if os.environ.get('RANK') == '1':\n"
        "    def boom(*a, **k):\n"
        "        raise InputError('injected failure on this rank')\n"
        "    speculative.SpeculativeEngine.generate = boom\n"
        "from dsparkctl.cli.main import main\n"
        "main()\n")
    t0 = time.perf_counter()
    res = run(["generate", "--target", str(models["target"]), "--draft", str(models["draft"]), "--prompts-file",
               str(models["prompts"]), "--batch-size", "2", "--max-new-tokens", "8", "--json"], ranks=2,
              script=script, timeout=180)
    took = time.perf_counter() - t0
    assert res.returncode != 0
    assert "rank 1 error: injected failure on this rank" in res.stderr
    assert took < 120, f"the job took {took:.0f}s to end"


def test_a_split_divides_units_round_robin_unless_the_ranks_share_one_model(monkeypatch):
    """In process: what `Split` gives rank 1 of 3 (data parallel), and everything when the ranks hold
    shards of one target (tensor parallel) or in one process."""
    from dsparkctl import distributed
    from dsparkctl.distributed import DATA_PARALLEL, Split

    assert DATA_PARALLEL.mine(range(7)) == list(range(7)) and DATA_PARALLEL.merged("p") == ["p"]
    monkeypatch.setattr(distributed, "_WORLD", distributed.World(rank=1, size=3))
    assert DATA_PARALLEL.active and DATA_PARALLEL.mine(range(7)) == [1, 4]
    tp = Split(replicated=True)
    assert not tp.active and tp.mine(range(7)) == list(range(7)) and tp.merged("p") == ["p"]
