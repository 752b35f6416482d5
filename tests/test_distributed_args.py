"""torchrun ranks that disagree are refused before any work (issue 20, classes 2 and 4): the
check across ranks (`distributed.check_same_everywhere`) covers the arguments and the contents of
the files they name; every rank says it in one line (`rank N error: ...`), no traceback, no
abort, nothing written, and the job ends promptly."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import tiny_recipe, write_tiny_prompts
from tests.tiny_models import save_tiny_target

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # two torchrun ranks: real processes, 10-30 s a test

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dargs")
    target = save_tiny_target(d / "target", "llama")
    prompts = write_tiny_prompts(d / "p.txt")
    for rank, steps in ((0, 2), (1, 3)):  # same file name, other folders, other contents
        (d / f"rank{rank}").mkdir()
        (d / f"rank{rank}" / "r.toml").write_text(tiny_recipe(target, prompts, optim={"steps": steps}))
    return d


@pytest.mark.parametrize("case,script_body,needle", [
    ("other arguments", "if os.environ['RANK'] == '1':\n    sys.argv += ['--max-steps', '1']\n"
                        "os.chdir(os.path.join(D, 'rank0'))\n", "were started with other arguments than rank 0"),
    ("same file name, other contents", "os.chdir(os.path.join(D, 'rank' + os.environ['RANK']))\n",
     "read other contents than rank 0 from r.toml"),
])
def test_disagreeing_ranks_are_refused_in_one_line_each(setup, tmp_path, case, script_body, needle):
    script = tmp_path / "launch.py"
    script.write_text("import os, sys\n" f"sys.path.insert(0, {str(ROOT)!r})\nD = {str(setup)!r}\n" + script_body
                      + "from dsparkctl.cli.main import main\nmain()\n")
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "--monitor-interval=0.5", str(script), "train", "r.toml", "--cache-dir",
                          str(tmp_path / "cache"), "--out", str(out)], capture_output=True, text=True, env=env,
                         timeout=180)
    took = time.perf_counter() - t0
    assert res.returncode != 0
    for r in (0, 1):
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith(f"rank {r} error:")]
        assert len(lines) == 1 and needle in lines[0], res.stderr[-2000:]
    lines = res.stderr.splitlines()
    end = next((i for i, ln in enumerate(lines) if "torch/distributed" in ln or "torch.distributed" in ln), len(lines))
    ours = "\n".join(lines[:end])  # what the ranks said, before torchrun's own report
    assert "Traceback" not in ours and "dsparkctl/" not in ours and "terminate called" not in res.stderr, ours[-2000:]
    assert not out.exists() and not (tmp_path / "cache").exists()
    assert took < 90, f"the job took {took:.0f}s to end"
